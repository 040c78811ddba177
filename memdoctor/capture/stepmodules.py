"""A step's per-module columns: bytes saved for backward, gradients, optimizer state, calls, and the
forward and backward times, from the samples the hooks appended (``memdoctor.capture.stepbuild``).

Times are unions of spans, inclusive of submodules, so that no module outlasts its caller or its step
whatever the shape of the loop: micro-batches, LBFGS closures, RNN cells called once a time step.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memdoctor.capture.stepbuild import Sample, StepData


def close_open_backward(data: StepData, samples: list[Sample]) -> None:
    """Modules whose inputs take no gradient never report a backward end: close each at the last
    backward sample of its own backward pass, the one before the next training forward. A step runs
    several passes (micro-batches; LBFGS calls its closure, a forward and a backward, several times
    in one optimizer step): closing them all at the step's last backward sample summed overlapping
    spans, and gave the root a backward longer than its step."""
    backward = [i for i, s in enumerate(samples) if s.event.startswith("bwd")]
    if not backward:
        return
    forwards = [i for i, s in enumerate(samples) if s.event == "fwd_pre" and s.depth == 0]
    for key, starts in data.bwd_open.items():
        for start in starts:
            if start > backward[-1]:
                continue
            nxt = bisect.bisect_right(forwards, start)
            limit = forwards[nxt] if nxt < len(forwards) else len(samples)
            end = backward[bisect.bisect_left(backward, limit) - 1]
            data.bwd_pairs.append((key, start, max(start, end)))
        starts.clear()


def module_columns(
    data: StepData, t_ms: list[float], index: dict[int, tuple[int, int]], parents: dict[int, list[int]]
) -> dict[int, dict[str, list[Any]]]:
    sizes: dict[int, int] = {}
    for model, i in index.values():
        sizes[model] = max(sizes.get(model, 0), i + 1)
    cols = {m: _empty_columns(n) for m, n in sizes.items()}

    def put(col: str, loc: tuple[int, int] | None, value: float) -> None:
        if loc is not None:
            cols[loc[0]][col][loc[1]] += value

    for key, n in data.act_incl.items():
        put("activation_bytes", index.get(key), n)
    for key, n in data.act_self.items():
        put("activation_self_bytes", index.get(key), n)
    for key, free in data.ckpt_free.items():
        loc = index.get(key)
        if free is None and loc is not None:
            cols[loc[0]]["checkpoint_free_bytes"][loc[1]] = None
        else:
            put("checkpoint_free_bytes", loc, max(0, free or 0))
    for key, n in data.calls.items():
        put("calls", index.get(key), n)
    for loc, n in data.grad_bytes.items():
        put("grad_bytes", loc, n)
    for loc, n in data.opt_bytes.items():
        put("optimizer_state_bytes", loc, n)
    for col, pairs in (("forward_ms", data.fwd_pairs), ("backward_ms", data.bwd_pairs)):
        for loc, ms in _busy_ms(pairs, t_ms, index, parents).items():
            put(col, loc, ms)
    # None where not measured: modules below the timing depth, and backward where none ran (a step
    # cut short in its forward).
    timed = {
        "forward_ms": {index[k] for k, _, _ in data.fwd_pairs if k in index},
        "backward_ms": {index[k] for k, _, _ in data.bwd_pairs if k in index},
    }
    for m, c in cols.items():
        for col, locs in timed.items():
            c[col] = [round(x, 4) if (m, i) in locs else None for i, x in enumerate(c[col])]
    return cols


def _busy_ms(
    pairs: list[tuple[int, int, int]],
    t_ms: list[float],
    index: dict[int, tuple[int, int]],
    parents: dict[int, list[int]],
) -> dict[tuple[int, int], float]:
    """Per module, the time it or a module inside it ran: the union of its calls' (start, end) spans
    and its submodules', not their sum. Spans overlap: an RNN cell's backward for one time step
    starts as the next one's ends, at the same tensor's hooks (summed, a cell called 20 times a pass
    came out longer than the model calling it), and a module and its only child share their input
    and output tensors, whose hooks fire child first. So no module outlasts its parent or its step."""
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for key, a, b in pairs:
        loc = index.get(key)
        if loc is not None and b < len(t_ms):
            spans.setdefault(loc, []).append((t_ms[a], max(t_ms[a], t_ms[b])))
    timed = set(spans)
    for model, i in sorted(timed, key=lambda loc: (loc[0], -loc[1])):  # children follow parents
        up = parents.get(model) or []
        p = up[i] if i < len(up) else -1
        while p >= 0 and (model, p) not in timed:  # a container never called itself (a ModuleList)
            p = up[p] if p < len(up) else -1
        if p >= 0:
            spans[(model, p)] += spans[(model, i)]
    return {loc: _union_ms(found) for loc, found in spans.items()}


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


_INT_COLUMNS = (
    "activation_bytes",
    "activation_self_bytes",
    "checkpoint_free_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "calls",
)


def _empty_columns(n: int) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {c: [0] * n for c in _INT_COLUMNS}
    cols["forward_ms"] = [0.0] * n
    cols["backward_ms"] = [0.0] * n
    return cols
