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
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from memdoctor.analysis import heatmap as layer_time
from memdoctor.analysis import nvtx as nvtx_note
from memdoctor.analysis.gradnorms import grad_norm_chart
from memdoctor.analysis.headline import CATEGORY_LABELS, memory_limit
from memdoctor.analysis.layers import layer_table, top_layers
from memdoctor.analysis.notes import collector_note
from memdoctor.analysis.steps import peak_step, timeline_series
from memdoctor.analysis.summary import shown_events
from memdoctor.config import CONFIG_FILENAME, config_for_summary, dump_config
from memdoctor.errors import OutputError
from memdoctor.report import plots, plots_heatmap
from memdoctor.report.sections import report_sections
from memdoctor.report.summary import SUMMARY_FILENAME, build_summary, embedded_summary, summary_json
from memdoctor.trace import CATEGORIES, PHASES, Trace
from memdoctor.units import format_bytes
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
    env.filters.update(bytes=format_bytes, pct=format_pct, ms=format_ms, collector_note=collector_note)
    return env


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
    return environment().get_template(TEMPLATE).render(**context)


def write_report(trace: Trace, out_dir: Path, summary: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write ``report.html``, ``summary.json`` and, when there is a plan, ``memdoctor.yaml`` into ``out_dir``
    (each atomically); return their paths. ``summary``: the trace's, when the caller has built it."""
    out_dir = Path(out_dir)
    with trace.frozen():  # see Trace.frozen: the summary and the report ask the same of all steps
        summary = summary if summary is not None else build_summary(trace)
        html = render_report(
            trace, summary, _relative(str((out_dir / CONFIG_FILENAME).absolute()), os.getcwd())
        )
        paths = {"summary": out_dir / SUMMARY_FILENAME, "report": out_dir / REPORT_FILENAME}
        atomic_write(paths["summary"], summary_json(summary))
        atomic_write(paths["report"], html)
        config = config_for_summary(trace, summary)
    if config is not None:  # the plan as memdoctor.yaml, under the same write and --force policy
        paths["config"] = out_dir / CONFIG_FILENAME
        atomic_write(paths["config"], dump_config(config))
    return paths


def atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and ``os.replace``, so a reader never sees half a file."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; check the output folder") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------------------- context


# Rows of the step table and steps of the gradient-norm line a report shows (summary.json has them all).
STEP_ROWS = 1000
GRAD_NORM_ROWS = 100


def report_context(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """Everything the template reads: the summary plus tables and plots derived from the trace."""
    step = peak_step(trace)
    limit, limit_label = memory_limit(summary)
    series = plots.thin_series(timeline_series(step)) if step is not None else None
    heatmap = layer_time.heatmap(trace, step)
    return {
        "summary": summary,
        "summary_json": embed_json(embedded_summary(summary, STEP_ROWS)),
        "run": run_info(trace),
        "limit": limit,
        "limit_label": limit_label,
        "categories": category_rows(summary),
        "layers": layer_table(trace, step),
        "layer_chart": plots.layer_bars(top_layers(trace, step)) if step else None,
        "timeline_chart": plots.timeline(series, limit, limit_label) if series else None,
        "timeline_limit_off_scale": bool(series and limit and plots.limit_off_scale(series, limit)),
        "allocator_measured": step is not None and step.timeline.get("allocated") is not None,
        "timeline_skipped_ms": series["skipped_ms"] if series else 0.0,
        "timeline_thinned": series["thinned"] if series else 1,
        "heatmap": heatmap,
        "heatmap_chart": plots_heatmap.layer_heatmap(heatmap),
        "heatmap_missing": layer_time.why_not(trace, step) if heatmap is None else None,
        "grad_chart": plots.grad_norms(grad_norm_chart(trace)),
        "sections": report_sections(trace, summary),
        "steps": [summary["steps"][i] for i in shown_events(len(summary["steps"]), STEP_ROWS)],
        "steps_left_out": max(0, len(summary["steps"]) - STEP_ROWS),
        "grad_norm_rows": (summary.get("grad_norm") or [])[:GRAD_NORM_ROWS],
        "grad_norm_left_out": max(0, len(summary.get("grad_norm") or []) - GRAD_NORM_ROWS),
        "phases": _phase_names(summary),
        "nvtx": nvtx_note.report_note(trace),
        "events": _event_rows(trace, summary),
        "colors": plots.COLORS,
        "memdoctor_version": __version__,
    }


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


def apply_command(trace: Trace, config_path: str) -> str:
    """``memdoctor run --config PATH SCRIPT -- ARGS``: the plan applied to the unmodified script."""
    cmd = script_command(trace)
    if not cmd:
        return f"memdoctor run --config {shlex.quote(config_path)} SCRIPT -- ARGS"
    n = 2 if cmd[0] == "-m" else 1
    return shlex.join(["memdoctor", "run", "--config", config_path, *cmd[:n], "--", *cmd[n:]])


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
    }


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
        for c in CATEGORIES
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
