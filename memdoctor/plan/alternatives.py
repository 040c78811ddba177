"""What the planner's pick is compared with: the configs a reader may prefer (``alternatives``: the
fastest, the least memory, the one that keeps the numerics) and the hand-tuning rules (``every_n_baseline``,
``hand_tuning_baseline``), kept as the baseline the search must beat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memdoctor.analysis.layers import repeated_blocks
from memdoctor.plan.checkpoints import checkpointed, with_checkpoints
from memdoctor.plan.config import Config
from memdoctor.plan.model import Prediction
from memdoctor.plan.padding import PAD_MULTIPLE
from memdoctor.plan.planner import Plan
from memdoctor.plan.target import Target, cost, fits, fp16_allowed, known_oom, predict_for
from memdoctor.plan.tiers import accumulations, tier_one, tier_two
from memdoctor.plan.workload import Candidate, Workload
from memdoctor.trace import Trace

ALTERNATIVES = ("chosen", "fastest", "least_memory", "numerics_preserving")


def alternatives(w: Workload, target: Target, plan: Plan) -> dict[str, dict[str, Any] | None]:
    """The plan beside the configs a reader may prefer, all from the configs both search tiers evaluate
    (``make_plan`` stops at the first tier that fits; this looks at both):

    * ``chosen``: the planner's pick (null when nothing fits);
    * ``fastest``: the fitting config with the least predicted slowdown (may use fp16 or the 8-bit
      optimizer, which ``chosen`` avoids while tier one fits); null when nothing fits;
    * ``least_memory``: the lowest predicted reserved peak of every config evaluated, fitting or not;
    * ``numerics_preserving``: no autocast and no 8-bit optimizer: the fastest one that fits, else the
      one closest to fitting.

    Checkpoints are chosen per config only as far as the budget needs them, so ``least_memory`` is the
    least of what the search tried, not the least any config could reach."""
    keep = [p for p in (with_checkpoints(w, c, target) for c in tier_one(w, target)) if p is not None]
    more = [p for p in (with_checkpoints(w, c, target) for c in tier_two(w, target)) if p is not None]
    every = [plan.baseline, *keep, *more]
    fitting = [p for p in every if fits(p, target)]
    same = [p for p in [plan.baseline, *keep] if fits(p, target) and p.config.precision == "fp32"]
    picks = {
        "chosen": plan.chosen,
        "fastest": min(fitting, key=cost, default=None),
        "least_memory": min(every, key=lambda p: p.reserved_bytes),
        "numerics_preserving": min(same, key=cost, default=None)
        or min([p for p in [plan.baseline, *keep] if p.config.precision == "fp32"], key=_reserved),
    }
    return {name: _alternative(p, target) if p is not None else None for name, p in picks.items()}


def _alternative(p: Prediction, target: Target) -> dict[str, Any]:
    return {
        "levers": p.config.levers(),
        "config": p.config.as_dict(),
        "fits": fits(p, target),
        "predicted_peak_bytes": p.peak_bytes,
        "predicted_reserved_bytes": p.reserved_bytes,
        "predicted_step_time_ratio": p.as_dict()["predicted_step_time_ratio"],
    }


def _reserved(p: Prediction) -> int:
    return p.reserved_bytes


def every_n_baseline(
    trace: Trace, w: Workload, target: Target, config: Config | None = None
) -> Prediction | None:
    """The hand-tuning rule: checkpoint every N-th block of the model's largest stack of repeated blocks,
    with the largest N that fits (fewest blocks); None when even every block does not fit."""
    config = config or Config()
    stack = block_stack(trace, w)
    for n in range(len(stack), 0, -1):
        picked = stack[::n]
        p = predict_for(w, checkpointed(config, picked), target)
        if fits(p, target):
            return p
    return None


def hand_tuning_baseline(trace: Trace, w: Workload, target: Target) -> Prediction | None:
    """The hand-tuning decision order, the baseline the search must beat. Not enough memory: is the step
    compute-bound (compute class high or medium, or not measured)? Then checkpoint every N-th block
    (``every_n_baseline``: the largest N that fits) at every later stage too; else offload (the
    embedding/head parameters and the optimizer state). Then dynamic batching: trim padding to the
    longest sequence, then halve the micro-batch (gradient accumulation 2, 4, 8). Then mixed
    precision: bf16 where the card has it, else fp16 where the precision verdict allows. Each stage
    keeps the levers of the ones before; the first config that fits is returned, None when none does."""
    base = predict_for(w, Config(), target)
    if fits(base, target) and not known_oom(w, base.config, target):
        return base
    checkpointing = w.compute_class != "low"
    for config in _hand_tuning_stages(w, target, checkpointing):
        p = every_n_baseline(trace, w, target, config) if checkpointing else predict_for(w, config, target)
        if p is None and checkpointing and not block_stack(trace, w):
            p = predict_for(w, config, target)  # no repeated blocks to checkpoint
        if p is not None and fits(p, target):
            return p
    return None


def _hand_tuning_stages(w: Workload, target: Target, checkpointing: bool) -> list[Config]:
    """The cumulative configs of the hand-tuning order (checkpoints are chosen per stage by the caller)."""
    offloads = target.offloads(w)  # not on a CPU run: host memory is the device's
    holders = tuple(h.name for h in w.param_holders) if offloads else ()
    placement = "offload" if w.has_optimizer and offloads else "as-is"
    config = Config() if checkpointing else Config(optimizer=placement, offload_parameters=holders)
    stages = [config]
    if w.padding is not None:
        config = dataclasses.replace(config, padding="trim", pad_to_multiple_of=PAD_MULTIPLE)
        stages.append(config)
    for a in accumulations(w)[1:]:
        if a & (a - 1):  # halving by hand: 2, 4, 8 (the planner also tries 3 and 6)
            continue
        config = dataclasses.replace(config, accumulation_steps=a)
        stages.append(config)
    fp16 = fp16_allowed(w)  # measured safe; its GradScaler needs an optimizer
    precision = "bf16" if target.bf16(w) else "fp16" if fp16 else None
    if precision and w.script_autocast is None:  # a script under its own autocast keeps it
        stages.append(dataclasses.replace(config, precision=precision))
    return stages


def block_stack(trace: Trace, w: Workload) -> list[Candidate]:
    by_key = {c.key: c for c in w.candidates}
    stacks = [
        [by_key[(info.index, i)] for i in blocks if (info.index, i) in by_key]
        for info in trace.models
        for blocks in repeated_blocks(info)
    ]
    return max(stacks, key=lambda s: sum(c.free_bytes for c in s), default=[])
