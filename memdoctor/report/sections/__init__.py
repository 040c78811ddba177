"""The report's sections after the memory overview, in report order: one module each.

A section's module has the name of its template, ``templates/sections/<name>.html.j2``, and a
``report_section(trace, summary) -> dict | None``: the context the template renders as ``ctx`` (None:
the section says it was not measured). It reads ``summary.json``'s data and the pure data functions
of ``memdoctor.analysis`` (and ``memdoctor.plan``), and draws its charts.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from memdoctor.report.sections import compute, config, data, devicefacts, plan, precision, transfers, verify
from memdoctor.trace import Trace

# plan after the measuring sections, whose figures it explains; config: the plan as memdoctor.yaml and
# its exports; verify: the plan applied and measured (profile --verify)
SECTIONS: tuple[ModuleType, ...] = (devicefacts, compute, data, transfers, precision, plan, config, verify)


def report_sections(trace: Trace, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{name, template, ctx}]`` for the report, in order; ``ctx`` None means not measured."""
    out = []
    for section in SECTIONS:
        name = section.__name__.rsplit(".", 1)[-1]
        ctx = section.report_section(trace, summary)
        out.append({"name": name, "template": f"sections/{name}.html.j2", "ctx": ctx})
    return out
