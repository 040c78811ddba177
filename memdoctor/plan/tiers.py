"""The configs the planner searches, in two tiers (``memdoctor.plan.planner``'s docstring): every
combination of micro-batching, precision and optimizer placement with the levers that keep the
numerics and the data and cost no time, each only where the trace measured what it acts on.
"""

from __future__ import annotations

import itertools
from typing import Any

from memdoctor.plan.config import EXPANDABLE_SEGMENTS, Config
from memdoctor.plan.padding import PAD_MULTIPLE
from memdoctor.plan.parallel import spread
from memdoctor.plan.target import Target, fp16_allowed
from memdoctor.plan.workload import Workload

# Micro-batch counts searched. Not only powers of two: every split divides unevenly where it must and
# weighs each micro-batch's loss by its share of the samples (``levers.apply.split_batch``, the forward
# and DataLoader splits), the script's own arguments only where its batch divides (``Split.allows``), and
# ``accumulations`` keeps divisors of the measured batch: a batch of 12 gets 3 and 6 as well (4 x 3 was
# the minimal GPT's best hand configuration on the H200, BENCHMARKS.md).
ACCUMULATIONS = (1, 2, 3, 4, 6, 8)


def _free_levers(w: Workload, target: Target) -> list[dict[str, Any]]:
    """Combinations of the levers that keep the numerics and the data and cost no time (or save some):
    trimming padding to the longest sequence (only where that lowers the peak — the longest batch seen
    is shorter than the padded length — and the mean batch gets ``TRIM_MIN_SAVING`` shorter: batches
    that change shape cost time; a smaller saving is the ``dynamic_padding`` finding's),
    memory-efficient attention, expandable segments, and parameter offload of the largest, least
    compute-heavy holders (on a device whose memory is not the host's: ``Target.offloads``); each only
    where the trace measured what it acts on."""
    trims = (
        w.padding is not None and w.padding.ratio("trim", PAD_MULTIPLE) < 1.0 and w.padding.worth_trimming()
    )
    paddings: list[tuple[str, int | None]] = [("as-is", None)] + ([("trim", PAD_MULTIPLE)] if trims else [])
    attention: list[str | None] = [None] + (["sdpa"] if w.attention_temporaries > 0 else [])
    allocator: list[str | None] = [None] + ([EXPANDABLE_SEGMENTS] if w.reserved_ratio > 1.0 else [])
    names = [h.name for h in w.param_holders] if target.offloads(w) else []
    offload = [tuple(names[:k]) for k in range(len(names) + 1)]
    return [
        {"padding": p, "pad_to_multiple_of": m, "attention": a, "allocator": al, "offload_parameters": o}
        for (p, m), a, al, o in itertools.product(paddings, attention, allocator, offload)
    ]


def tier_one(w: Workload, target: Target) -> list[Config]:
    """Levers that keep the script's numbers, and bf16 autocast where the target card runs it natively:
    bf16 keeps fp32's exponent range (no loss scaling, no overflow: the precision section's overflow and
    underflow risks are fp16's), and on such a card it is the fastest lever there is. Hand tuning that
    tries every precision change last left bf16's 4x on the table on the H200 (BENCHMARKS.md, the
    BERT-base b32 s512 scenario). The numerics-preserving alternative stays in the report. A script
    under its own autocast keeps it: "fp32" (add no autocast) is then its precision, and no other is
    tried (changing the script's own dtype is not memdoctor's call). On a named card without bf16 but
    with fp16 tensor cores (Turing, Volta), fp16 with its GradScaler takes bf16's place where the
    measured ranges keep it safe (``Target.fp16_first``)."""
    precisions = ["fp32"] + (["bf16"] if target.bf16(w) and w.script_autocast is None else [])
    precisions += ["fp16"] if target.fp16_first(w) else []
    configs = [
        Config(accumulation_steps=a, precision=p, optimizer=o, **extra)
        for a in accumulations(w)
        for p in precisions
        for o in optimizer_placements(w, ("as-is", "offload"), target)
        for extra in _free_levers(w, target)
    ] + full_offload_configs(w, target, precisions)
    return spread(w, target.gpus, configs)


def tier_two(w: Workload, target: Target) -> list[Config]:
    """Only when nothing in tier one fits: fp16 (where the measured ranges make it safe and the card has
    no bf16; unless tier one had it already) and the 8-bit optimizer."""
    precisions = ["fp32"] + (["bf16"] if target.bf16(w) and w.script_autocast is None else [])
    if fp16_allowed(w) and not target.bf16(w):  # its GradScaler is driven from the optimizer's step
        precisions.append("fp16")
    placements = optimizer_placements(w, ("as-is", "8bit", "offload"), target)
    combos = itertools.product(accumulations(w), precisions, placements, _free_levers(w, target))
    new_fp16 = not target.fp16_first(w)  # else tier one tried fp16 already, without the 8-bit optimizer
    configs = [
        Config(accumulation_steps=a, precision=p, optimizer=o, **extra)
        for a, p, o, extra in combos
        if (p == "fp16" and new_fp16) or o == "8bit"
    ] + full_offload_configs(w, target, [p for p in precisions if p == "fp16" and new_fp16])
    return spread(w, target.gpus, configs)


def full_offload_configs(w: Workload, target: Target, precisions: list[str]) -> list[Config]:
    """Parameters, gradients and optimizer state all on the host (FSDP2 with CPU offload), with every
    micro-batch split, the given precisions and the free levers (parameter offload aside: it is part of
    it): only where the model's state alone (parameters + gradients + optimizer state) exceeds the
    budget, the case it exists for, where the trace's module table says what the units hold, and on a
    device whose memory is not the host's (``Target.offloads``)."""
    state = w.parameters + w.gradients + w.optimizer_state
    if not w.shard_units or state <= target.limit_bytes or not target.offloads(w):
        return []
    return [
        Config(accumulation_steps=a, precision=p, full_offload=True, **extra)
        for a in accumulations(w)
        for p in precisions
        for extra in _free_levers(w, target)
        if not extra["offload_parameters"]
    ]


# Optimizers that evaluate a closure several times per step: the host step of ``optimizer: offload``
# runs once before the step (``memdoctor.levers.offload_optimizer`` refuses them), and the 8-bit
# optimizers replace Adam-type state only.
CLOSURE_OPTIMIZERS = frozenset({"LBFGS"})


def optimizer_placements(w: Workload, choices: tuple[str, ...], target: Target) -> tuple[str, ...]:
    """``choices`` of the ``optimizer`` lever; only "as-is" for a script without an optimizer (its
    parameters updated by hand: there is no state to offload or quantise, and ``memdoctor run`` would
    find no optimizer to apply it to) and for one that steps with a closure (LBFGS): a lever ``memdoctor
    run`` would refuse is never proposed. No "offload" where host memory is the device's (a CPU run)."""
    if not w.has_optimizer or CLOSURE_OPTIMIZERS & set(w.optimizer_classes):
        return ("as-is",)
    return tuple(c for c in choices if c != "offload" or target.offloads(w))


def accumulations(w: Workload) -> list[int]:
    """Micro-batch splits to try: only where a split applies to this script (``memdoctor.plan.splits``:
    known before it is proposed), and only divisors of the batch when its size was measured. None for a
    script without an optimizer: ``memdoctor run`` finds its model at its first forward, too late to
    split that one, and has no optimizer step to count steps by."""
    if not w.has_optimizer:
        return [1]
    sized = [
        a for a in ACCUMULATIONS if w.batch_size is None or (w.batch_size % a == 0 and w.batch_size >= a)
    ]
    return [a for a in sized if w.split.allows(a)]
