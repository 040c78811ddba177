"""A rank's peak under FSDP2 (``fully_shard`` on the shard units and then the root, not offloaded), moment
by moment: the largest of the moments of the step below, each holding the sharded state, that moment's
share of the gradients and activations, and the buffers FSDP2 holds then. Measured on gloo ranks
against the per-rank hook ledger (benchmarks/rank_accuracy.py; BENCHMARKS.md, "Several ranks on the
CPU"):

- **forward end** (the root's own forward after its last unit): every activation but the loss's, the
  root's parameters gathered and the last unit's all-gather output, which FSDP2 keeps until the root's
  forward ends (``fsdp2-no-reshard``: every unit gathered as well);
- **loss** (the root resharded, or everything kept gathered without resharding): every activation;
- **the backward of each shard unit**, last to first, as it starts and as it ends: the gradients of the
  units already reduced (sharded), the activations of the units not yet back-propagated (the loss's
  freed by its own backward; an equal share a unit), the root's parameters and gradients, the unit's
  parameters and the prefetched previous unit's (without resharding: every unit not yet
  back-propagated), the unit's unsharded gradients as it ends, and the reduce-scatter input of the
  unit before it, which FSDP2 keeps until the next reduce-scatter.

The optimizer step is ``parallel.engine_floor``. Which moment peaks depends on the model: a small batch
and a large state peak late in backward (gradients pile up while the activations are few), a large batch
as the backward starts.
"""

from __future__ import annotations

import math

from memdoctor.analysis.steps import peak_step
from memdoctor.plan.config import Config
from memdoctor.plan.memory import activation_scale, ranks
from memdoctor.plan.workload import Workload
from memdoctor.trace import Trace

STATE = ("parameters", "gradients", "optimizer_state", "activations")


def forward_end(trace: Trace) -> tuple[int | None, int | None]:
    """The activations and gradients the peak step held at the end of its forward (the sample that
    held the most activations), which a peak elsewhere (the optimizer step) does not show; (None, None)
    where the step has no per-module ledger."""
    step = peak_step(trace)
    tl = (step.timeline if step is not None else None) or {}
    acts, grads = tl.get("activations"), tl.get("gradients")
    if not acts or not grads or len(acts) != len(grads):
        return None, None
    i = max(range(len(acts)), key=lambda j: acts[j] or 0)
    return int(acts[i] or 0), int(grads[i] or 0)


def fsdp_parts(
    w: Workload,
    config: Config,
    parts: dict[str, int],
    units: tuple[int, ...],
    assumptions: list[str],
) -> dict[str, int]:
    """The parts of a rank's peak under FSDP2: those of the largest moment (module docstring).
    ``parts``: the one-process parts at a rank's share of the batch; ``units``: the shard units'
    parameter bytes (the rest of the parameters is the root's unit)."""
    n = ranks(config)
    moments = _moments(w, config, parts, units)
    name = max(moments, key=lambda m: sum(moments[m]))
    grads, acts, gathered, unsharded_grads = moments[name]
    out = {k: v for k, v in parts.items() if k not in STATE}
    out.update(
        parameters=math.ceil(w.parameters / n),
        gradients=grads,
        optimizer_state=math.ceil(parts["optimizer_state"] / n),
        activations=acts,
        unsharded_parameters=gathered,
        unsharded_gradients=unsharded_grads,
    )
    assumptions.append(
        f"FSDP2 over {n} ranks: parameters, gradients and optimizer state / {n}; the rank peaks at the "
        f"{name} (the largest of the forward end, the loss and each shard unit's backward: at each, the "
        "gradients and activations held then, and the parameters gathered and gradients not yet "
        "reduce-scattered FSDP2 holds; measured on CPU gloo ranks, benchmarks/rank_accuracy.py)"
    )
    return out


def _moments(
    w: Workload, config: Config, parts: dict[str, int], units: tuple[int, ...]
) -> dict[str, tuple[int, int, int, int]]:
    """Each moment's (sharded gradients, activations, gathered parameters, unsharded gradients).
    ``units`` in module order: the forward runs them first to last, the backward last to first."""
    n, k = ranks(config), len(units)
    root = max(0, w.parameters - sum(units))
    ratio = w.gradients / w.parameters if w.parameters else 1.0
    scale = activation_scale(w, config)
    acts = _forward_activations(w, config, parts, scale)
    loss = min(acts, int(w.outside_bytes * scale))  # freed by the loss's backward, before any unit's
    kept = acts - loss
    g0 = w.gradients_at_peak if w.forward_end_gradients is None else w.forward_end_gradients
    g0 = math.ceil(g0 / n)
    reshard = config.parallel != "fsdp2-no-reshard"
    last = units[-1] if units else 0  # its all-gather output, kept until the root's forward ends
    every = 0 if reshard else sum(units)
    out = {
        "forward end": (g0, kept, root + every + last, 0),
        "loss": (g0, acts, 0 if reshard else root + every, 0),
    }
    if not k:  # the root alone: gathered for its backward, its gradients accumulating
        out["backward"] = (g0, kept, root, round(root * ratio))
    backward: dict[str, tuple[int, int, int, int]] = {}
    for i in reversed(range(k)):
        done = max(g0, math.ceil(sum(units[i + 1 :]) * ratio / n))  # reduced, sharded
        gathered = root + (units[i] + (units[i - 1] if i else 0) if reshard else sum(units[: i + 1]))
        # The root's gradients, and the input of the reduce-scatter before (kept until the next one).
        waiting = round((root + (units[i + 1] if i + 1 < k else 0)) * ratio)
        unit = f"shard unit {i + 1} of {k}"
        backward[f"backward start of {unit}"] = (done, kept * (i + 1) // k, gathered, waiting)
        backward[f"backward end of {unit}"] = (
            done,
            kept * i // k,
            gathered,
            waiting + round(units[i] * ratio),
        )
    if backward:
        name = max(backward, key=lambda m: sum(backward[m]))
        out[name] = backward[name]
    return out


def _forward_activations(w: Workload, config: Config, parts: dict[str, int], scale: float) -> int:
    """The activations a rank holds at the end of its forward: the one-process model's at the
    measured peak, plus what the forward end held beyond it (a peak in the optimizer step holds
    few), at a rank's share; with checkpointing, the one-process model's as they are."""
    measured = w.forward_end_activations
    if measured is None or config.checkpoint:
        return parts["activations"]
    return parts["activations"] + int(max(0, measured - w.activations) * scale)
