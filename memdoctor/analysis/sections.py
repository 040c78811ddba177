"""The report's instrument sections: one analysis module per collector, found by name.

Each module named in ``SECTIONS`` may define

* ``summarize(trace, summary) -> None``: add its keys to ``summary.json`` (top-level keys, and fields
  of the rows in ``summary["layers"]``), always, with nulls where the trace did not measure them;
* ``report_section(trace, summary) -> dict | None``: the context of its report section, which
  ``templates/sections/<name>.html.j2`` renders as ``ctx`` (None: the section says "not measured").

The analysis stays pure (no torch); plots are drawn by the module's ``report_section`` through
``memdoctor.report.plots``. A module that is missing is skipped, so sections land one at a time.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from memdoctor.trace import Trace

# section name -> analysis module, in report order.
SECTIONS: dict[str, str] = {
    "devicefacts": "memdoctor.analysis.devicefacts",
    "compute": "memdoctor.analysis.flops",
    "data": "memdoctor.analysis.data",
    "transfers": "memdoctor.analysis.transfers",
    "precision": "memdoctor.analysis.histograms",
    "plan": "memdoctor.plan.summarize",  # after the measuring sections: it reads their summary keys
    "config": "memdoctor.report.exports",  # the plan as memdoctor.yaml and its exports
    "verify": "memdoctor.analysis.verified",  # profile --verify: the plan applied and measured
}


def collector_note(notes: Iterable[Any] | None, name: str) -> str | None:
    """Why collector ``name`` measured nothing: the reason of the first ``"NAME: reason"`` entry of a
    trace's ``not_measured`` notes (``memdoctor.capture.collectors.make_collectors`` writes them), or
    None. Also the ``collector_note`` filter of the report's templates."""
    prefix = f"{name}:"
    for note in notes or ():
        text = str(note)
        if text.startswith(prefix):
            return text[len(prefix) :].strip()
    return None


def _modules() -> list[tuple[str, ModuleType]]:
    out = []
    for name, path in SECTIONS.items():
        try:
            out.append((name, importlib.import_module(path)))
        except ModuleNotFoundError as exc:
            if exc.name != path:  # the module exists but an import inside it failed: a real bug
                raise
    return out


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """Let every section add its keys to ``summary``."""
    for _, mod in _modules():
        fn = getattr(mod, "summarize", None)
        if fn is not None:
            fn(trace, summary)


def report_sections(trace: Trace, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{name, template, ctx}]`` for the report, in order; ``ctx`` None means not measured."""
    out = []
    for name, mod in _modules():
        fn = getattr(mod, "report_section", None)
        if fn is not None:
            out.append({"name": name, "template": f"sections/{name}.html.j2", "ctx": fn(trace, summary)})
    return out
