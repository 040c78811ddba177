"""Planning from a re-profile with every repeated block checkpointed, where no micro-batch split applies.

Why: a run that died before its step finished left its peak, and often the modules after the one it
died in, unmeasured. A re-profile at a smaller micro-batch (``memdoctor.plan.reprofiled``) needs a split
that ``memdoctor run`` can apply (``memdoctor.plan.splits``); a ``get_batch()`` loop with no batch-size
and accumulation arguments, whose model returns no loss, has none. Checkpointing needs no access to
the batch or the loss: with every block of the model's repeated stacks checkpointed
(``blocks_to_checkpoint``), the full batch's step holds only each block's input, so it often finishes
where the script as it is died, and every module runs.

What that run measures, and how the script's own step is rebuilt from it (``checkpointed_workload``):

* each checkpointed block's own activations: its forward is measured as if it were not checkpointed
  (``memdoctor.levers.apply.SeeThrough`` shows the ledger what the block saves, which the checkpoint
  then drops), so a block's ``checkpoint_free_bytes`` (what it saved less its inputs) is what it holds
  from the end of its forward to the end of its backward in the script as it is. Assumed: the forward
  the checkpoint runs saves what the unchecked forward would (the same ops on the same inputs);
* the script's peak: at each timeline sample of the step, the tensor accounting the checkpointed run
  measured plus the bytes of every block whose forward had ended and whose backward had not (held from
  its ``fwd_post`` up to its ``bwd_post``: all of it through its own backward, an upper bound there);
  the largest sum, plus what the allocator held beyond the accounting at the measured peak (workspaces,
  temporaries; 0 on a CPU), and never less than the checkpointed run's own peak. Assumed: nothing else
  changes with checkpointing (on a GPU the allocator's "other" at the measured peak may include one
  block's recomputation: an over-estimate of at most that block);
* its time: the checkpointed step less one forward of each checkpointed block (its recomputation);
  module forward times are measured in the forward only.

Parameters, gradients, optimizer state, the checkpoint candidates (every module's ``checkpoint_free_bytes``
is measured) and everything else the planner reads come from the checkpointed run as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memdoctor.analysis.layers import children, layer_table, repeated_blocks
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.workload import Workload
from memdoctor.trace import ModelInfo, StepRecord, Trace

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


def blocks_to_checkpoint(trace: Trace) -> tuple[ModelInfo | None, list[str]]:
    """The model with the most parameters and the members of its repeated stacks of blocks (modules
    with children: checkpointing a leaf frees nothing, its saved input is what a checkpoint keeps),
    outermost stacks only (``repeated_blocks``); no names when it has none."""
    if not trace.models:
        return None, []
    info = max(trace.models, key=lambda m: (sum(m.param_bytes), -m.index))
    kids = children(info)
    blocks = [i for group in repeated_blocks(info) if kids[group[0]] for i in group]
    return info, [info.names[i] for i in blocks]


def checkpointed_workload(
    trace: Trace, summary: dict[str, Any], checkpointed: list[str], oom_budget: int | None
) -> Workload | None:
    """The script's own step, rebuilt from a run with the ``checkpointed`` modules checkpointed and
    seen through (module docstring); None without a memory figure or a detailed step."""
    w = measured_workload(trace, summary)
    if w is None:
        return None
    model = next((m for m in trace.models if m.index == w.model), None)
    steps = [s for s in trace.detailed_steps() if s.complete] or trace.detailed_steps()
    if model is None or not steps:
        return None
    index = {name: i for i, name in enumerate(model.names)}
    blocks = [index[n] for n in checkpointed if n in index]
    best = max((_rebuilt(trace, s, model.index, blocks) for s in steps), key=lambda r: r["peak"])
    other = int((summary.get("categories") or {}).get("other") or 0)  # the allocator's beyond accounting
    peak = max(int(w.peak_bytes), best["peak"] + other)
    activations = best["activations"]
    grads = best["gradients"]
    temporaries = min(w.temporaries, max(0, peak - w.parameters - grads - w.optimizer_state - activations))
    fixed = max(0, peak - w.parameters - grads - w.optimizer_state - activations - temporaries)
    recompute = sum(best["forward_ms"])
    note = (
        f"planned from a re-profile with {len(blocks)} blocks checkpointed at the full batch "
        f"({', '.join(checkpointed[:3])}{', ...' if len(checkpointed) > 3 else ''}): each block's "
        "activations measured in its forward (as if not checkpointed) and added back from the end of its "
        f"forward to the end of its backward ({best['held']} bytes at the rebuilt peak); the step time "
        f"is that run's less one forward of each block ({recompute:.1f} ms of recomputation)"
    )
    return dataclasses.replace(
        w,
        peak_bytes=peak,
        gradients_at_peak=grads,
        activations=activations,
        temporaries=temporaries,
        fixed=fixed,
        step_ms=_less(w.step_ms, recompute),
        fwd_bwd_ms=_less(w.fwd_bwd_ms, recompute),
        as_is_oom_budget=oom_budget,
        notes=[*w.notes, note],
    )


def _rebuilt(trace: Trace, step: StepRecord, model: int, blocks: list[int]) -> dict[str, Any]:
    """The script's peak sample of ``step`` with the checkpointed ``blocks`` held as the script holds
    them: ``peak`` (accounted bytes), ``activations``, ``gradients``, ``held`` (the blocks' bytes added
    there) and each block's ``forward_ms``."""
    rows = {r["index"]: r for r in layer_table(trace, step) if r["model"] == model}
    tl = step.timeline
    n = len(tl.get("t_ms") or [])
    cols = {c: [int(v or 0) for v in (tl.get(c) or [0] * n)] for c in CATEGORIES}
    held = [0] * n
    for b in blocks:
        row = rows.get(b) or {}
        # untimed (never with the round's time depth): all it saved, its input too (an upper bound)
        free = row.get("checkpoint_free_bytes")
        free = int(free if free is not None else row.get("activation_bytes") or 0)
        start, end = _held_span(tl, model, b, n)
        for i in range(start, end):
            held[i] += free
    totals = [sum(cols[c][i] for c in CATEGORIES) + held[i] for i in range(n)]
    at = max(range(n), key=lambda i: totals[i], default=None)
    ms = [float(rows[b]["forward_ms"] or 0.0) for b in blocks if b in rows]
    if at is None:
        return {"peak": 0, "activations": 0, "gradients": 0, "held": 0, "forward_ms": ms}
    return {
        "peak": totals[at],
        "activations": cols["activations"][at] + held[at],
        "gradients": cols["gradients"][at],
        "held": held[at],
        "forward_ms": ms,
    }


def _held_span(tl: dict[str, Any], model: int, block: int, n: int) -> tuple[int, int]:
    """Timeline samples [start, end) over which the script as it is holds ``block``'s activations: from
    its first forward end in the step's own forward to its last backward end (without one, the end of
    the step's backward). A block without samples (called deeper than the timing depth) is taken as
    held from the model's forward end through the whole backward."""
    events, phases = tl.get("event") or [], tl.get("phase") or []
    models, modules = tl.get("model") or [None] * n, tl.get("module") or [None] * n
    mine = [i for i in range(n) if models[i] == model and modules[i] == block]
    start = next((i for i in mine if events[i] == "fwd_post" and phases[i] == "forward"), None)
    if start is None:
        mine = []
        start = next(
            (i for i in range(n) if models[i] == model and modules[i] == 0 and events[i] == "fwd_post"), n
        )
    ends = [i for i in mine if events[i] == "bwd_post" and i > start]
    if ends:
        return start, ends[-1]
    backward = [i for i in range(start, n) if phases[i] == "backward"]
    return start, (backward[-1] + 1 if backward else n)


def _less(ms: float | None, recompute: float) -> float | None:
    return None if ms is None else max(ms - recompute, 0.0)
