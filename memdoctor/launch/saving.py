"""Writing a finished run's outputs when the disk may be full: each file is tried, and the run says which
were written, which were not and why, and where what was measured is kept.

The final trace is written first (atomically: ``save_trace``); only once it is there is the partial
trace removed, so that a trace that cannot be saved leaves the partial one, which holds every finished
step (``memdoctor report --salvage OUT/trace.jsonl.gz.partial`` reads it). The report and summary
follow; they are written atomically too, so a file that failed is either the old one or absent, never
half written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memdoctor.config.file import CONFIG_FILENAME
from memdoctor.errors import OutputError
from memdoctor.outputs import display_path
from memdoctor.report.render import REPORT_FILENAME
from memdoctor.report.summary import SUMMARY_FILENAME
from memdoctor.trace import TRACE_FILENAME, Trace, paused_gc, save_trace


@dataclass
class Saved:
    paths: dict[str, Path] = field(default_factory=dict)  # written: "trace", "summary", "report", "config"
    failed: list[tuple[Path, str]] = field(default_factory=list)  # (file, why) not written
    kept: Path | None = None  # where the measurements are: the trace, or else the partial trace


def save_outputs(trace: Trace, out_dir: Path, partial: Path) -> Saved:
    """Save the trace, then the report and summary (see the module docstring)."""
    saved = Saved()
    trace_path = out_dir / TRACE_FILENAME
    try:
        save_trace(trace, trace_path)
    except OSError as exc:
        saved.failed.append((trace_path, _reason(exc)))
        saved.kept = partial if partial.exists() else None
        return _report_not_tried(saved, out_dir, "the trace was not saved")
    saved.paths["trace"] = saved.kept = trace_path
    trace.path = str(trace_path)  # where it lives now: the report's commands and the config name this file
    partial.unlink(missing_ok=True)
    with paused_gc():  # a long run's trace is millions of objects: see paused_gc
        write_report_files(saved, trace, out_dir)
    return saved


def write_report_files(
    saved: Saved, trace: Trace, out_dir: Path, summary: dict[str, Any] | None = None
) -> Saved:
    """``write_report`` into ``out_dir``, adding to ``saved`` the files written and those that were not
    (summary first, then the report: a full disk can leave one written and not the other)."""
    from memdoctor.report import write_report

    targets = {
        "summary": out_dir / SUMMARY_FILENAME,
        "report": out_dir / REPORT_FILENAME,
        "config": out_dir / CONFIG_FILENAME,
    }
    before = {key: _identity(path) for key, path in targets.items()}
    try:
        saved.paths.update(write_report(trace, out_dir, summary))
    except (OutputError, OSError) as exc:  # write_report words an OSError as an OutputError
        written = {k: p for k, p in targets.items() if _identity(p) not in (None, before[k])}
        saved.paths.update(written)
        reason = _reason(exc) if isinstance(exc, OSError) else _output_reason(exc)
        for key in ("summary", "report"):
            if key not in written:
                saved.failed.append((targets[key], reason))
    return saved


def _output_reason(exc: Exception) -> str:
    """The reason in an ``OutputError`` of ``write_report`` (``cannot write PATH: REASON``)."""
    text = str(exc)
    return text.rsplit(": ", 1)[-1] if ": " in text else text


def _report_not_tried(saved: Saved, out_dir: Path, why: str) -> Saved:
    for name in (SUMMARY_FILENAME, REPORT_FILENAME):
        saved.failed.append((out_dir / name, why))
    return saved


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime): an atomic replace changes it, so a file written now is told from an old one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def failure_line(saved: Saved, steps: int) -> str | None:
    """One line: what was not written and why, what was, and where the measurements are kept."""
    if not saved.failed:
        return None
    first_reason = saved.failed[0][1]
    names = ", ".join(p.name for p, _ in saved.failed)
    text = f"could not write {names} ({first_reason})"
    if saved.kept is not None:
        text += f"; kept: {steps} complete steps in {display_path(saved.kept)}"
        if saved.kept.name.endswith(".partial"):
            text += f" (memdoctor report --salvage {display_path(saved.kept)} renders it)"
    else:
        text += "; nothing measured was kept"
    written = [p.name for p in saved.paths.values()]
    text += f"; written: {', '.join(written)}" if written else "; nothing else was written"
    return text
