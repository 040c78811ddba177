"""``memdoctor check`` and ``memdoctor diff``: guard a recorded run's memory in CI, compare two runs.

Both read the same figures as ``summary.json`` (``build_summary`` of the trace), so a budget checked in
CI and the number in the report can never disagree. A report folder without its trace (only
``summary.json``) is accepted too: everything compared here is in the summary. The comparison is
plain data; ``memdoctor.report.diff`` writes it as text and as ``diff.html``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memdoctor.errors import TraceError, UsageError
from memdoctor.report import SUMMARY_FILENAME, build_summary
from memdoctor.trace import TRACE_FILENAME, load_trace
from memdoctor.units import format_bytes

TOP_CHANGED_LAYERS = 10


@dataclass
class Run:
    """One side of a comparison: where it came from and its summary."""

    path: Path
    summary: dict[str, Any]


def load_run(path: Path) -> Run:
    """A trace file, a folder holding ``trace.jsonl.gz``, or a report folder holding ``summary.json``."""
    path = Path(path)
    if path.is_dir():
        if (path / TRACE_FILENAME).is_file():
            path = path / TRACE_FILENAME
        elif (path / SUMMARY_FILENAME).is_file():
            return Run(path, _read_summary(path / SUMMARY_FILENAME))
        else:
            raise TraceError(f"{path}: no {TRACE_FILENAME} or {SUMMARY_FILENAME} in this folder")
    if path.name == SUMMARY_FILENAME:
        return Run(path, _read_summary(path))
    return Run(path, build_summary(load_trace(path)))


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: cannot read the summary ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: not a memdoctor summary (not a JSON object)")
    return data


# ----------------------------------------------------------------------------------------- check


@dataclass
class Verdict:
    """The outcome of ``memdoctor check``: within budget or not, and one line per limit checked."""

    ok: bool
    lines: list[str]


def check_run(
    run: Run, max_peak: int | None, max_ratio: float | None, baseline: Run | None = None
) -> Verdict:
    """Compare a run with the limits; a limit that cannot be checked (no figure) is a usage error."""
    if max_peak is None and max_ratio is None:
        raise UsageError("give a limit to check: --max-peak SIZE and/or --max-step-time-ratio X")
    lines: list[str] = []
    ok = True
    if max_peak is not None:
        peak_ok, line = _check_peak(run, max_peak)
        ok &= peak_ok
        lines.append(line)
    if max_ratio is not None:
        if baseline is None:
            raise UsageError("--max-step-time-ratio needs --baseline TRACE to compare the step time with")
        ratio_ok, line = _check_ratio(run, baseline, max_ratio)
        ok &= ratio_ok
        lines.append(line)
    return Verdict(ok, lines)


def _check_peak(run: Run, max_peak: int) -> tuple[bool, str]:
    peak = run.summary.get("peak_memory_bytes")
    if not isinstance(peak, int):
        raise UsageError(f"{run.path}: the run has no peak memory figure (no step was profiled)")
    share = f"{100 * peak / max_peak:.0f}%"
    if peak > max_peak:
        # The exact byte count too: near the budget, rounded sizes would read "653 MiB exceeds 653 MiB".
        over = (
            f"{format_bytes(peak - max_peak)} ({peak - max_peak:,} bytes, {_pct(peak - max_peak, max_peak)})"
        )
        return False, f"peak {format_bytes(peak)} exceeds the budget {format_bytes(max_peak)} by {over}"
    return True, f"peak {format_bytes(peak)} is within the budget {format_bytes(max_peak)} ({share} of it)"


def _pct(part: int, whole: int) -> str:
    share = 100 * part / whole
    return f"{share:.2g}%" if share < 1 else f"{share:.1f}%"


def _check_ratio(run: Run, baseline: Run, max_ratio: float) -> tuple[bool, str]:
    t, t0 = run.summary.get("step_time_ms"), baseline.summary.get("step_time_ms")
    if not isinstance(t, (int, float)) or not isinstance(t0, (int, float)) or t0 <= 0:
        raise UsageError("a step time is missing from the run or the baseline: cannot compare step times")
    ratio = t / t0
    text = f"step time {t:.1f} ms is {ratio:.2f}x the baseline's {t0:.1f} ms"
    if ratio > max_ratio:
        return False, f"{text}, over the limit {max_ratio:g}x"
    return True, f"{text}, within the limit {max_ratio:g}x"


# ----------------------------------------------------------------------------------------- diff


def diff_runs(a: Run, b: Run, top: int = TOP_CHANGED_LAYERS) -> dict[str, Any]:
    """Plain data for the terminal table and ``diff.html``: headline rows, categories, changed layers."""
    sa, sb = a.summary, b.summary
    rows = [
        _row("peak memory", sa.get("peak_memory_bytes"), sb.get("peak_memory_bytes"), "bytes"),
        _row("step time", sa.get("step_time_ms"), sb.get("step_time_ms"), "ms"),
        _row("steps profiled", sa.get("steps_profiled"), sb.get("steps_profiled"), "count"),
    ]
    cats_a, cats_b = sa.get("categories") or {}, sb.get("categories") or {}
    names = list(dict.fromkeys([*cats_a, *cats_b]))
    categories = [_row(n.replace("_", " "), cats_a.get(n), cats_b.get(n), "bytes") for n in names]
    return {
        "a": {"path": str(a.path), "headline": sa.get("headline"), "device": _device(sa)},
        "b": {"path": str(b.path), "headline": sb.get("headline"), "device": _device(sb)},
        "rows": rows,
        "categories": categories,
        "layers": changed_layers(sa.get("layers") or [], sb.get("layers") or [], top),
    }


def _device(summary: dict[str, Any]) -> str:
    device = summary.get("device") or {}
    return str(device.get("name") or device.get("kind") or "unknown")


def _row(label: str, va: Any, vb: Any, unit: str) -> dict[str, Any]:
    num = (int, float)
    delta = vb - va if isinstance(va, num) and isinstance(vb, num) else None
    ratio = vb / va if delta is not None and va else None
    return {"label": label, "a": va, "b": vb, "delta": delta, "ratio": ratio, "unit": unit}


def changed_layers(la: list[dict[str, Any]], lb: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The ``top`` modules (by qualified name) whose activation + parameter bytes changed the most.

    Roots (depth 0) are left out: their change is the whole model's, already in the peak row. A module
    present on one side only counts as changed from/to nothing.
    """
    rows_a = {r.get("name"): r for r in la if r.get("depth", 1)}
    rows_b = {r.get("name"): r for r in lb if r.get("depth", 1)}
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys([*rows_a, *rows_b]):
        ra, rb = rows_a.get(name), rows_b.get(name)
        act = (_int(ra, "activation_bytes"), _int(rb, "activation_bytes"))
        par = (_int(ra, "param_bytes"), _int(rb, "param_bytes"))
        change = abs(act[1] - act[0]) + abs(par[1] - par[0])
        if change:
            out.append(
                {
                    "name": str(name),
                    "type": str((rb or ra or {}).get("type") or ""),
                    "activation_a": act[0] if ra else None,
                    "activation_b": act[1] if rb else None,
                    "param_a": par[0] if ra else None,
                    "param_b": par[1] if rb else None,
                    "change": change,
                }
            )
    return sorted(out, key=lambda r: -int(r["change"]))[:top]


def _int(row: dict[str, Any] | None, key: str) -> int:
    value = (row or {}).get(key)
    return int(value) if isinstance(value, (int, float)) else 0
