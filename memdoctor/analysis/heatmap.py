"""The layer x time memory heatmap: whose saved activations are live at each moment of the peak step.

The quantity is the trace's own tensor accounting of saved activations (the timeline's ``activations``
column, sampled at every timed module call's start and end, forward and backward). Its change between two
consecutive samples is attributed to the layer running in that interval: in the forward, the innermost
module on the call stack; in the backward, the module inside a layer whose backward began last (autograd
frees what a module saved while that module's backward runs). A layer's value at a moment is the running
sum of what was attributed to it: the activations it saved and still holds. The rows therefore add up to
the timeline's activation total; what was live before the step began, or was saved outside every layer (the
root's own ops, a loss outside the model), forms the row "rest".

What the heatmap does not show: parameters, gradients, optimizer state (they belong to no moment of the
forward) and temporaries (the accounting sees only saved tensors). A layer below the timing depth has no
samples of its own, so its activations go to the timed module that encloses it, or to "rest".

Rows are the memory-by-layer chart's layers, in model order; more than ``MAX_ROWS`` are merged into
consecutive groups (summed). Time is cut into ``COLUMNS`` equal bins; a bin shows the most a layer held in
it. Pure data: ``memdoctor.report.plots_heatmap`` draws it.
"""

from __future__ import annotations

import math
from typing import Any

from memdoctor.analysis.layers import top_layer_modules
from memdoctor.analysis.steps import timeline_series
from memdoctor.trace import ModelInfo, StepRecord, Trace

MAX_ROWS = 48
COLUMNS = 240
REST_SHARE = 0.01  # the "rest" row is shown when it ever holds this share of the largest total
Key = tuple[int, int]  # (model index, module index)


def heatmap(trace: Trace, step: StepRecord | None) -> dict[str, Any] | None:
    """The heatmap of ``step`` as plot-ready data, or None when its timeline has no activation figures."""
    if step is None:
        return None
    series = timeline_series(step)
    act = step.timeline.get("activations")
    layers = top_layer_modules(trace, step)
    if act is None or len(series["t_ms"]) < 2 or not layers:
        return None
    first = len(step.timeline.get("t_ms") or []) - len(series["t_ms"])  # the set-up sample, when skipped
    if not _sampled_rows(step, layers):
        return None  # no layer has samples of its own: there is nothing to attribute to layers
    owners, deltas, start = attribute(step, first, _row_map(layers))
    groups, labels, per_row = _groups(trace, layers)
    rows = _cumulative(owners, deltas, start, groups, len(labels) + 1)
    values = [_bins(series["t_ms"][: len(r)], r) for r in rows]
    top = max((sum(col) for col in zip(*values, strict=True)), default=0)
    if top <= 0:
        return None
    if max(values[-1]) < REST_SHARE * top:
        values = values[:-1]
    else:
        labels = [*labels, "rest: outside these layers"]
    return {
        "step": step.step,
        "rows": labels,
        "values": values,
        "t0_ms": series["t_ms"][0],
        "t1_ms": series["t_ms"][-1],
        "columns": COLUMNS,
        "layers": len(layers),
        "per_row": per_row,
        "untimed": _untimed(step, layers),
        "stride": step.timeline_stride,
        "phases": series["phases"],
        "peak_t_ms": series["peak_t_ms"],
        "max_bytes": max(max(v) for v in values),
    }


def why_not(trace: Trace, step: StepRecord | None) -> str:
    """Why ``heatmap`` is None, in words for the report."""
    if step is None:
        return "no step was recorded"
    if step.timeline.get("activations") is None or len(step.timeline.get("t_ms") or []) < 2:
        return f"step {step.step} has no memory timeline with saved-activation figures"
    if not any(step.timeline["activations"] or []):
        return f"step {step.step} saved no activations for backward"
    return (
        f"no layer of step {step.step} was timed (they ran below the timing depth, --time-depth), so the "
        "timeline has no samples to attribute to layers; the per-layer figures are in the table below"
    )


def attribute(step: StepRecord, first: int, row_of: dict[Key, int]) -> tuple[list[int], list[int], int]:
    """For every sample after ``first``: the row that owns the change in saved activations since the
    previous sample (``len(rows)``-th, "rest", for none), that change, and the activations at ``first``."""
    tl = step.timeline
    act = [int(v or 0) for v in tl.get("activations") or []]
    events, phases = tl.get("event") or [], tl.get("phase") or []
    keys = _keys(tl)
    rest = max(row_of.values(), default=-1) + 1
    stack: list[Key] = []
    last_bwd: Key | None = None
    owners, deltas = [], []
    for i in range(first, min(len(act), len(events), len(phases), len(keys))):
        if i > first:
            owner = _owner(phases[i], stack, last_bwd, row_of)
            owners.append(rest if owner is None else owner)
            deltas.append(act[i] - act[i - 1])
        last_bwd = _advance(events[i], keys[i], stack, last_bwd, row_of)
    return owners, deltas, act[first]


def _keys(tl: dict[str, list[Any] | None]) -> list[Key | None]:
    models, modules = tl.get("model") or [], tl.get("module") or []
    return [
        (int(m if m is not None else 0), int(x)) if isinstance(x, int) else None
        for m, x in zip(models, modules, strict=False)
    ]


def _owner(phase: Any, stack: list[Key], last_bwd: Key | None, row_of: dict[Key, int]) -> int | None:
    """The row running in an interval of ``phase``: the innermost forward call; else, once a backward
    has begun, the latest one (the tensors of the last module's backward are freed as it ends, which the
    next sample, the optimizer's, may be the first to see)."""
    if phase == "forward":
        return row_of.get(stack[-1]) if stack else None
    return row_of.get(last_bwd) if last_bwd is not None else None


def _advance(
    event: Any, key: Key | None, stack: list[Key], last_bwd: Key | None, row_of: dict[Key, int]
) -> Key | None:
    """Apply one sample to the call stack; return the latest backward of a module inside a layer (a
    wrapper's backward hook fires after its first child's, and must not take the child's frees). A
    ``fwd_post`` whose ``fwd_pre`` was dropped (a strided timeline) leaves the stack alone."""
    if key is None:
        return last_bwd
    if event == "fwd_pre":
        stack.append(key)
    elif event == "fwd_post" and key in stack:
        del stack[len(stack) - 1 - stack[::-1].index(key) :]
    elif event == "bwd_pre" and key in row_of:
        return key
    return last_bwd


def _row_map(layers: list[tuple[ModelInfo, int]]) -> dict[Key, int]:
    """Every module in a layer's subtree -> that layer's row (parents precede children in the table)."""
    out: dict[Key, int] = {}
    rows = {(info.index, i): r for r, (info, i) in enumerate(layers)}
    for info in {id(info): info for info, _ in layers}.values():
        for j, parent in enumerate(info.parents):
            row = rows.get((info.index, j))
            if row is None and parent >= 0:
                row = out.get((info.index, parent))
            if row is not None:
                out[(info.index, j)] = row
    return out


def _groups(trace: Trace, layers: list[tuple[ModelInfo, int]]) -> tuple[list[int], list[str], int]:
    """Layer -> display row, the rows' labels, and how many layers a row holds (consecutive, summed)."""
    per_row = max(1, math.ceil(len(layers) / MAX_ROWS))
    names = [_name(trace, info, i) for info, i in layers]
    labels = []
    for g in range(0, len(names), per_row):
        chunk = names[g : g + per_row]
        labels.append(chunk[0] if len(chunk) == 1 else _span(chunk[0], chunk[-1]))
    return [r // per_row for r in range(len(layers))], labels, per_row


def _span(first: str, last: str) -> str:
    """``encoder.layer.0 … 2`` for ``encoder.layer.0`` to ``encoder.layer.2``: the shared dotted prefix
    once (short labels keep the chart small: each character of a label is a path in the SVG)."""
    a, b = first.split("."), last.split(".")
    k = 0
    while k < min(len(a), len(b)) - 1 and a[k] == b[k]:
        k += 1
    return f"{first} … {'.'.join(b[k:])}"


def _name(trace: Trace, info: ModelInfo, i: int) -> str:
    return (f"model{info.index}:" if len(trace.models) > 1 else "") + info.display_name(i)


def _cumulative(
    owners: list[int], deltas: list[int], start: int, groups: list[int], n: int
) -> list[list[int]]:
    """Per display row, its bytes at every sample (negative running sums, frees of what another layer
    saved, clipped to 0)."""
    vals = [0] * n
    vals[-1] = start
    rows: list[list[int]] = [[v] for v in vals]
    for owner, delta in zip(owners, deltas, strict=True):
        vals[groups[owner] if owner < len(groups) else n - 1] += delta
        for r in range(n):
            rows[r].append(max(0, vals[r]))
    return rows


def _bins(t: list[float], values: list[int]) -> list[int]:
    """``COLUMNS`` equal time bins: the most held in each (a bin without a sample keeps the value the
    last sample before it left)."""
    t0, span = t[0], (t[-1] - t[0]) or 1.0
    most: list[int | None] = [None] * COLUMNS
    end = [0] * COLUMNS
    held = values[0]  # a sample's value holds until the next sample
    for ti, v in zip(t, values, strict=True):
        b = min(COLUMNS - 1, int((ti - t0) / span * COLUMNS))
        before = most[b]
        most[b] = max(v, held if before is None else before)
        end[b] = held = v
    out, last = [], values[0]
    for b in range(COLUMNS):
        m = most[b]
        out.append(last if m is None else m)
        last = last if m is None else end[b]
    return out


def _untimed(step: StepRecord, layers: list[tuple[ModelInfo, int]]) -> int:
    """Layers that ran in the step (``calls``) but none of whose modules has a timeline sample: called
    below the timing depth. (Layers a dying step never reached are not counted.)"""
    seen = _sampled_rows(step, layers)
    ran = [r for r, (info, i) in enumerate(layers) if _calls(step, info, i)]
    return sum(1 for r in ran if r not in seen)


def _sampled_rows(step: StepRecord, layers: list[tuple[ModelInfo, int]]) -> set[int]:
    """The layers (rows) with at least one timeline sample of a module inside them."""
    row_of = _row_map(layers)
    return {row_of[k] for k in _keys(step.timeline) if k is not None and k in row_of}


def _calls(step: StepRecord, info: ModelInfo, i: int) -> int:
    calls = (step.modules.get(info.index) or {}).get("calls") or []
    return int(calls[i] or 0) if i < len(calls) else 0
