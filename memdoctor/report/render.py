"""Turn a trace into the HTML report and ``summary.json``.

One cached jinja2 environment (autoescape on) fills ``templates/report.html.j2`` from the data the
analysis returns; plots are inlined as data URIs and the summary is embedded as JSON, so the report is one
file that opens offline. Nothing here decides policy (overwriting, paths): the caller does.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from memdoctor.analysis import heatmap as layer_time
from memdoctor.analysis import nvtx as nvtx_note
from memdoctor.analysis.gradnorms import grad_norm_chart
from memdoctor.analysis.headline import CATEGORY_LABELS, memory_limit
from memdoctor.analysis.layers import ENGINE_CATEGORIES, layer_table, top_layers
from memdoctor.analysis.notes import collector_note
from memdoctor.analysis.steps import peak_step, timeline_series
from memdoctor.analysis.summary import shown_events
from memdoctor.config import CONFIG_FILENAME, config_for_summary, dump_config
from memdoctor.outputs import atomic_write
from memdoctor.report import plots, plots_heatmap
from memdoctor.report.firstscreen import apply_command, first_screen
from memdoctor.report.glossary import LEVER_TERMS, TERMS, glossary_rows
from memdoctor.report.peaks import footer_note, peak_rows
from memdoctor.report.sections import report_sections
from memdoctor.report.summary import SUMMARY_FILENAME, build_summary, embedded_summary, summary_json
from memdoctor.trace import CATEGORIES, PHASES, Trace
from memdoctor.units import MESSAGE_CHARS, NOTE_CHARS, format_bytes
from memdoctor.version import __version__

REPORT_FILENAME = "report.html"
TEMPLATE = "report.html.j2"


def template_dir() -> Path:
    """``memdoctor/templates`` in an installed wheel, else the repository's top-level ``templates/``."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "templates"
    return installed if installed.is_dir() else package.parent / "templates"


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(
        bytes=format_bytes, pct=format_pct, ms=format_ms, collector_note=collector_note, whole=whole_words
    )
    return env


# Lengths at which memdoctor before 2026-12-04 cut an exception's message or a collector's failure note
# (``units.clip`` now cuts at a word and says so): text exactly this long was cut, most likely mid-word.
CUT_LENGTHS = frozenset({MESSAGE_CHARS, NOTE_CHARS})


def whole_words(text: str | None) -> str:
    """A message an older trace cut at its length limit, shown up to its last whole sentence (else word)
    with an ellipsis, instead of ending mid-word; any other text as it is."""
    text = "" if text is None else str(text)
    if len(text) not in CUT_LENGTHS:
        return text
    sentence = text.rfind(". ")
    cut = sentence + 1 if sentence > len(text) // 2 else text.rfind(" ")
    return (text[:cut] if cut > 0 else text).rstrip() + " …"


def format_pct(value: float | None, digits: int = 0) -> str:
    """``0.62 -> '62%'``; a small non-zero share keeps one significant decimal (``'0.04%'``)."""
    if value is None:
        return "n/a"
    if 0 < abs(value) < 0.01:
        return f"{100 * value:.2g}%"
    return f"{100 * value:.{digits}f}%"


def format_ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms"


def embed_json(data: Any) -> Markup:
    """JSON safe inside ``<script type="application/json">``: no raw ``<``, ``>`` or ``&`` can end it."""
    text = json.dumps(data, sort_keys=True, allow_nan=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_report(
    trace: Trace, summary: dict[str, Any] | None = None, config_path: str = CONFIG_FILENAME
) -> str:
    """The whole report as one HTML string (``summary`` is computed when not given); ``config_path`` is
    where the plan's ``memdoctor.yaml`` is written, for the command that applies it."""
    with trace.frozen():
        summary = summary if summary is not None else build_summary(trace)
        context = report_context(trace, summary)
        context["run"]["apply_command"] = apply_command(trace, config_path)
        context["first"] = first_screen(trace, summary, config_path)
    return environment().get_template(TEMPLATE).render(**context)


def write_report(trace: Trace, out_dir: Path, summary: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write ``report.html``, ``summary.json`` and, when there is a plan, ``memdoctor.yaml`` into ``out_dir``
    (each atomically); return their paths. ``summary``: the trace's, when the caller has built it."""
    out_dir = Path(out_dir)
    with trace.frozen():  # see Trace.frozen: the summary and the report ask the same of all steps
        summary = summary if summary is not None else build_summary(trace)
        html = render_report(trace, summary, str((out_dir / CONFIG_FILENAME).absolute()))
        paths = {"summary": out_dir / SUMMARY_FILENAME, "report": out_dir / REPORT_FILENAME}
        atomic_write(paths["summary"], summary_json(summary))
        atomic_write(paths["report"], html)
        config = config_for_summary(trace, summary)
    if config is not None:  # the plan as memdoctor.yaml, under the same write and --force policy
        paths["config"] = out_dir / CONFIG_FILENAME
        atomic_write(paths["config"], dump_config(config))
    return paths


# ----------------------------------------------------------------------------------------- context


# Rows of the step table and steps of the gradient-norm line a report shows (summary.json has them all).
STEP_ROWS = 1000
LAYER_TOP = 15  # rows of the modules table shown unfolded
GRAD_NORM_ROWS = 100


def report_context(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """Everything the template reads: the summary plus tables and plots derived from the trace."""
    step = peak_step(trace)
    limit, limit_label = memory_limit(summary)
    series = plots.thin_series(timeline_series(step)) if step is not None else None
    heatmap = layer_time.heatmap(trace, step)
    rows = layer_table(trace, step)
    return {
        "summary": summary,
        "summary_json": embed_json(embedded_summary(summary, STEP_ROWS)),
        "run": run_info(trace),
        "limit": limit,
        "limit_label": limit_label,
        "categories": category_rows(summary),
        "layers": rows,
        "layer_chart": layer_chart(trace, summary),
        "activations_live": activations_live(summary),
        "timeline_chart": plots.timeline(series, limit, limit_label) if series else None,
        "timeline_limit_off_scale": bool(series and limit and plots.limit_off_scale(series, limit)),
        "allocator_measured": step is not None and step.timeline.get("allocated") is not None,
        "timeline_skipped_ms": series["skipped_ms"] if series else 0.0,
        "timeline_thinned": series["thinned"] if series else 1,
        "heatmap": heatmap,
        "heatmap_chart": plots_heatmap.layer_heatmap(heatmap),
        "heatmap_missing": layer_time.why_not(trace, step) if heatmap is None else None,
        "grad_chart": plots.grad_norms(grad_norm_chart(trace)),
        "sections": {sec["name"]: sec for sec in report_sections(trace, summary)},
        "layer_top": own_top(rows),
        "glossary": glossary_rows(),
        "glossary_terms": TERMS,
        "lever_terms": LEVER_TERMS,
        "steps": [summary["steps"][i] for i in shown_events(len(summary["steps"]), STEP_ROWS)],
        "steps_left_out": max(0, len(summary["steps"]) - STEP_ROWS),
        "grad_norm_rows": (summary.get("grad_norm") or [])[:GRAD_NORM_ROWS],
        "grad_norm_left_out": max(0, len(summary.get("grad_norm") or []) - GRAD_NORM_ROWS),
        "phases": _phase_names(summary),
        "nvtx": nvtx_note.report_note(trace),
        "events": _event_rows(trace, summary),
        "colors": plots.COLORS,
        "memdoctor_version": __version__,
        "footer_note": footer_note(peak_rows(trace, summary), summary.get("findings") or []),
    }


# The peak holds "no activations" below this share of it (a few saved bytes can outlive the backward).
LIVE_ACTIVATION_SHARE = 0.01


def activations_live(summary: dict[str, Any]) -> bool:
    """Whether the peak held the activations: not when it came in the optimizer step, after the backward
    freed them (measured: the activations category at the peak is under 1% of it)."""
    acts, peak = (summary.get("categories") or {}).get("activations"), summary.get("peak_memory_bytes")
    return acts is None or not peak or acts >= LIVE_ACTIVATION_SHARE * peak


def layer_chart(trace: Trace, summary: dict[str, Any]) -> str | None:
    """The memory-by-layer bars of the peak step: layers the step never ran are marked, as not reached
    when the run died in that step (else as not called: an unused module), never drawn as cheap."""
    step = peak_step(trace)
    if step is None:
        return None
    unreached = "not reached (the run died first)" if not step.complete else "not called in this step"
    died_in = (summary.get("fault") or {}).get("module_name") if not step.complete else None
    return plots.layer_bars(top_layers(trace, step), activations_live(summary), unreached, died_in)


def script_command(trace: Trace) -> list[str]:
    """The profiled command as the user would type it: the script (relative to the working folder where
    it lies inside it) or ``-m module``, then its arguments."""
    command = trace.header.get("command") or {}
    script, cwd = command.get("script"), command.get("cwd")
    if command.get("module"):
        target = ["-m", str(command["module"])]
    elif script:
        target = [_relative(str(script), str(cwd)) if cwd else str(script)]
    else:
        target = []
    return target + [str(a) for a in command.get("argv") or []]


def _relative(path: str, folder: str) -> str:
    """``path`` relative to ``folder`` when it lies inside it (both absolute), else as given."""
    if not (os.path.isabs(path) and os.path.isabs(folder)):
        return path
    inside = os.path.commonpath([path, folder]) == folder
    return os.path.relpath(path, folder) if inside else path


def run_info(trace: Trace) -> dict[str, Any]:
    command = trace.header.get("command") or {}
    created = trace.header.get("created_unix")
    when = datetime.fromtimestamp(created, tz=timezone.utc) if isinstance(created, (int, float)) else None
    return {
        "argv": shlex.join(script_command(trace)),
        "cwd": command.get("cwd"),
        "created": when.strftime("%Y-%m-%d %H:%M UTC") if when else None,
        "host": trace.header.get("host") or {},
        "settings": trace.settings,
        "capability": trace.device.get("capability"),
        "end": {"status": "unknown", "message": "", **(trace.end or {})},  # in-process runs have no end
        "truncated": trace.truncated,
        "rank": _rank(trace),
    }


def _rank(trace: Trace) -> dict[str, Any] | None:
    """A rank of a several-process job (the header's ``distributed``): its rank and world size; its
    report sits in ``OUT/rank-K/``, beside the merged one in ``OUT``."""
    info = trace.header.get("distributed")
    if not isinstance(info, dict) or not isinstance(info.get("rank"), int):
        return None
    return {"rank": info["rank"], "world_size": info.get("world_size"), "backend": info.get("backend")}


def own_top(rows: list[dict[str, Any]], limit: int = LAYER_TOP) -> list[dict[str, Any]]:
    """The ``limit`` modules holding the most bytes themselves (own parameters, gradients, optimizer
    state and the activations of their own operations), largest first: exclusive figures, so no byte is
    counted twice (a parent's inclusive total would repeat its children's)."""
    own = [{**r, "own_bytes": sum(r[k] or 0 for k in _OWN_KEYS)} for r in rows]
    return sorted((r for r in own if r["own_bytes"] > 0), key=lambda r: -r["own_bytes"])[:limit]


_OWN_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_self_bytes")


def category_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per category at the peak: bytes, share of the peak, colour."""
    peak = summary.get("peak_memory_bytes") or 0
    cats = summary.get("categories") or {}
    return [
        {
            "key": c,
            "label": CATEGORY_LABELS[c],
            "bytes": cats.get(c),
            "share": (cats[c] / peak) if peak and cats.get(c) is not None else None,
            "color": plots.COLORS[c],
        }
        for c in (*CATEGORIES[:-1], *(e for e in ENGINE_CATEGORIES if e in cats), CATEGORIES[-1])
    ]


def _phase_names(summary: dict[str, Any]) -> list[str]:
    seen = {p for row in summary["steps"] for p in row["phases_ms"]}
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def _event_rows(trace: Trace, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary's event rows with each event's traceback from the trace added back."""
    shown = [trace.events[i] for i in shown_events(len(trace.events))]
    pairs = zip(summary["events"], shown, strict=True)
    return [{**row, "traceback": _traceback(event)} for row, event in pairs]


def _traceback(event: dict[str, Any]) -> list[str]:
    tb = event.get("traceback")
    return [str(line) for line in tb] if isinstance(tb, list) else []
