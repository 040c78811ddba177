"""The run's memory timeline as a Chrome trace-event JSON file, which ui.perfetto.dev and
chrome://tracing open: memory as counter tracks, steps, phases and module calls as slices.

The format is the Trace Event Format's JSON object form (``{"traceEvents": [...]}``): ``ph: "C"``
counter events (the tensor accounting's four categories, and the CUDA allocator's figures where they
were read), ``ph: "X"`` complete events (steps, phases, module calls), ``ph: "i"`` instant events (the
trace's events: an out-of-memory error, a stop) and ``ph: "M"`` metadata naming the tracks. Times are
microseconds on the run's clock (``memdoctor.analysis.runtimeline``).

Module calls go on one track per pass and depth (``forward, depth 2``): backward hooks fire per
gradient, so a module's backward can start before its parent's and end after it, and such calls
do not nest on one track. On a track, a call that runs past the next one's start is cut there, as
memdoctor's own ``backward_ms`` counts overlapping calls once.
"""

from __future__ import annotations

import json
from typing import Any

from memdoctor.analysis.runtimeline import (
    MEMORY_COLUMNS,
    module_spans,
    run_phase_spans,
    run_timeline,
    step_starts,
)
from memdoctor.analysis.steps import step_peak_bytes
from memdoctor.trace import CATEGORIES, Trace
from memdoctor.version import __version__

PID = 1
STEPS_TID, PHASES_TID = 1, 2
_PASS_TID = {"forward": 100, "backward": 200}  # + the call depth
ACCOUNTING = tuple(c for c in CATEGORIES if c != "other")  # what the tensor accounting samples
ALLOCATOR = tuple(c for c in MEMORY_COLUMNS if c not in ACCOUNTING)


def perfetto_trace(trace: Trace) -> dict[str, Any]:
    """The trace-event JSON object for ``trace`` (see the module docstring)."""
    cols = run_timeline(trace)
    spans = module_spans(trace, cols)
    events = _metadata(trace, spans)
    events += _counters(cols)
    events += _steps(trace)
    events += [
        _slice(PHASES_TID, s["phase"], s["start_ms"], s["end_ms"], {"step": s["step"]})
        for s in run_phase_spans(trace)
    ]
    events += _module_calls(spans)
    events += _instants(trace)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": f"memdoctor {__version__}",
            "source": trace.path,
            "device": trace.device.get("name"),
            "memory_unit": "bytes",
        },
    }


def perfetto_json(trace: Trace) -> str:
    """``perfetto_trace`` as compact, strict JSON text (no NaN: every figure is a measured number)."""
    return json.dumps(perfetto_trace(trace), separators=(",", ":"), allow_nan=False) + "\n"


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def _meta(name: str, tid: int, value: str, sort: int | None = None) -> list[dict[str, Any]]:
    out = [{"ph": "M", "name": name, "pid": PID, "tid": tid, "args": {"name": value}}]
    if sort is not None:
        out.append(
            {"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": sort}}
        )
    return out


def _metadata(trace: Trace, spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    command = trace.header.get("command") or {}
    what = command.get("script") or command.get("module") or "training script"
    device = trace.device.get("name") or "unknown device"
    events = _meta("process_name", 0, f"memdoctor: {what} on {device}")
    events += _meta("thread_name", STEPS_TID, "steps", STEPS_TID)
    events += _meta("thread_name", PHASES_TID, "phases", PHASES_TID)
    depths = {(s["kind"], s["depth"] or 0) for s in spans}
    for kind, depth in sorted(depths, key=lambda kd: (_PASS_TID[kd[0]], kd[1])):
        tid = _PASS_TID[kind] + depth
        events += _meta("thread_name", tid, f"{kind}, depth {depth}", tid)
    return events


def _counters(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """One counter event per timeline sample for the accounting, and one per sample where the
    allocator was read (its columns are None elsewhere: no value is made up between readings)."""
    events: list[dict[str, Any]] = []
    for i, time_ms in enumerate(cols["time_ms"]):
        accounted = {c: cols[c][i] for c in ACCOUNTING if cols[c][i] is not None}
        if accounted:
            events.append(_counter("memory (tensor accounting)", time_ms, accounted))
        allocator = {c: cols[c][i] for c in ALLOCATOR if cols[c][i] is not None}
        if allocator:
            events.append(_counter("CUDA allocator", time_ms, allocator))
    return events


def _counter(name: str, time_ms: float, values: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "C", "name": name, "pid": PID, "tid": 0, "ts": _us(time_ms), "args": values}


def _slice(tid: int, name: str, start_ms: float, end_ms: float, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "pid": PID,
        "tid": tid,
        "ts": _us(start_ms),
        "dur": max(0.0, _us(end_ms) - _us(start_ms)),
        "args": args,
    }


def _steps(trace: Trace) -> list[dict[str, Any]]:
    out = []
    for start, step in zip(step_starts(trace), trace.steps, strict=True):
        end = start + (step.duration_ms or _last(step.timeline.get("t_ms")))
        name = f"step {step.step}" + (" (warm-up)" if step.warmup else "")
        args = {
            "peak_bytes": step_peak_bytes(step),
            "peak_phase": step.memory.get("peak_phase"),
            "detail": step.detail,
            "complete": step.complete,
        }
        out.append(_slice(STEPS_TID, name, start, end, args))
    return out


def _last(times: list[Any] | None) -> float:
    return float(times[-1]) if times else 0.0


def _module_calls(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Module calls, one track per pass and depth; a call cut where the next one on its track begins."""
    by_track: dict[int, list[dict[str, Any]]] = {}
    for span in spans:
        by_track.setdefault(_PASS_TID[span["kind"]] + (span["depth"] or 0), []).append(span)
    out = []
    for tid, spans in by_track.items():
        spans.sort(key=lambda s: s["start_ms"])
        for k, s in enumerate(spans):
            end = min(s["end_ms"], spans[k + 1]["start_ms"]) if k + 1 < len(spans) else s["end_ms"]
            out.append(
                _slice(tid, s["name"] or "?", s["start_ms"], end, {"step": s["step"], "pass": s["kind"]})
            )
    return out


def _instants(trace: Trace) -> list[dict[str, Any]]:
    """The trace's events (errors, stops) at their time since profiling started."""
    t0 = trace.header.get("created_unix")
    out = []
    for ev in trace.events:
        t = ev.get("t_unix")
        if not isinstance(t, (int, float)) or not isinstance(t0, (int, float)):
            continue
        args = {"message": str(ev.get("message") or "")[:500]}
        out.append(
            {
                "ph": "i",
                "s": "g",
                "name": str(ev.get("kind") or "event"),
                "pid": PID,
                "tid": STEPS_TID,
                "ts": _us(max(0.0, (t - t0) * 1000.0)),
                "args": args,
            }
        )
    return out
