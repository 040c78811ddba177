"""The whole run's memory timeline on one clock: every step's samples, the module calls between them.

A step record's timeline counts milliseconds from that step's start, and a step lasts ``duration_ms``
from the end of the one before (``docs/trace-format.md``), so the run's clock is the sum of the
durations before a step plus the sample's own time. What notebooks (``memdoctor.load``) and the
exports to other viewers (``memdoctor.viewers``) read, as plain columns.
"""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.layers import module_label
from memdoctor.analysis.steps import phase_spans
from memdoctor.trace import StepRecord, Trace

# The timeline's columns, in order: where a sample is, then its memory figures (bytes).
PLACE_COLUMNS = ("step", "time_ms", "t_ms", "event", "phase", "depth", "model", "module", "name")
MEMORY_COLUMNS = (
    *("parameters", "gradients", "optimizer_state", "activations"),
    *("allocated", "reserved", "max_allocated"),
)
_PAIRS = {"fwd_pre": ("fwd_post", "forward"), "bwd_pre": ("bwd_post", "backward")}


def step_starts(trace: Trace) -> list[float]:
    """Each step record's start on the run's clock (ms since profiling started), in order. A step
    without a duration (the one a crash cut short) starts where the one before ended, and so does the
    next one after it: its length is unknown, not zero, and nothing after it is placed by guessing."""
    starts, at = [], 0.0
    for step in trace.steps:
        starts.append(at)
        at += step.duration_ms or _last_sample(step)
    return starts


def _last_sample(step: StepRecord) -> float:
    times = step.timeline.get("t_ms") or []
    return float(times[-1]) if times else 0.0


def run_timeline(trace: Trace) -> dict[str, list[Any]]:
    """Every step's timeline samples as columns (``PLACE_COLUMNS`` then ``MEMORY_COLUMNS``):
    ``time_ms`` on the run's clock, ``t_ms`` within the step, ``name`` the module's display name; a
    memory figure the step did not measure is None."""
    cols: dict[str, list[Any]] = {c: [] for c in (*PLACE_COLUMNS, *MEMORY_COLUMNS)}
    labels: dict[tuple[Any, Any], str | None] = {}
    for start, step in zip(step_starts(trace), trace.steps, strict=True):
        tl = step.timeline
        n = len(tl.get("t_ms") or [])
        cols["step"] += [step.step] * n
        cols["t_ms"] += [float(t) for t in tl.get("t_ms") or []]
        cols["time_ms"] += [start + float(t) for t in tl.get("t_ms") or []]
        for key in ("event", "phase", "depth", "model", "module", *MEMORY_COLUMNS):
            cols[key] += _column(tl.get(key), n)
        for model, module in zip(_column(tl.get("model"), n), _column(tl.get("module"), n), strict=True):
            if (model, module) not in labels:
                labels[(model, module)] = module_label(trace, model, module) if module is not None else None
            cols["name"].append(labels[(model, module)])
    return cols


def _column(values: list[Any] | None, n: int) -> list[Any]:
    return (list(values) + [None] * n)[:n] if values is not None else [None] * n


def module_spans(trace: Trace, cols: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """The module calls the timeline saw, as ``{step, model, module, name, kind, depth, start_ms,
    end_ms}`` on the run's clock: a ``fwd_pre`` sample to its ``fwd_post`` (kind ``forward``), a
    ``bwd_pre`` to its ``bwd_post`` (``backward``). A call whose end was not sampled (a crash, a
    downsampled timeline) is left out rather than stretched. ``cols``: ``run_timeline(trace)``, when
    the caller has it."""
    spans: list[dict[str, Any]] = []
    cols = cols if cols is not None else run_timeline(trace)
    open_calls: dict[tuple[Any, ...], list[int]] = {}
    for i, event in enumerate(cols["event"]):
        key = (cols["step"][i], cols["model"][i], cols["module"][i])
        if event in _PAIRS:
            open_calls.setdefault((*key, event), []).append(i)
        for pre, (post, kind) in _PAIRS.items():
            started = open_calls.get((*key, pre))
            if event == post and started:
                spans.append(_span(cols, started.pop(), i, kind))
    return sorted(spans, key=lambda s: (s["start_ms"], -s["end_ms"], s["depth"] or 0))


def _span(cols: dict[str, list[Any]], start: int, end: int, kind: str) -> dict[str, Any]:
    return {
        "step": cols["step"][start],
        "model": cols["model"][start],
        "module": cols["module"][start],
        "name": cols["name"][start],
        "kind": kind,
        "depth": cols["depth"][start],
        "start_ms": cols["time_ms"][start],
        "end_ms": cols["time_ms"][end],
    }


def run_phase_spans(trace: Trace) -> list[dict[str, Any]]:
    """Each step's runs of one phase (``phase_spans``) on the run's clock, with the step's number."""
    out: list[dict[str, Any]] = []
    for start, step in zip(step_starts(trace), trace.steps, strict=True):
        times = [start + float(t) for t in step.timeline.get("t_ms") or []]
        out += [
            {**span, "step": step.step} for span in phase_spans(times, list(step.timeline.get("phase") or []))
        ]
    return out
