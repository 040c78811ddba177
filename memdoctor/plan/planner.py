"""The planner: for a budget, the config that fits with a safety margin at the least predicted slowdown.

Search, in two tiers, following the usual hand-tuning decision order (memory levers first, numerics last):

1. levers that keep the numerics: activation checkpointing, micro-batch with gradient accumulation,
   optimizer state offload, and (where the trace measured what they act on) trimming padding to the
   longest sequence, memory-efficient attention, expandable segments, parameter offload;
2. only when tier 1 finds nothing: also autocast (bf16 where the card has it, fp16 only where the
   trace's precision verdict says fp16 is safe) and an 8-bit optimizer.

For every combination of the non-checkpoint levers, ``choose_checkpoints`` picks *which* modules to
checkpoint: greedily by measured bytes freed per millisecond of recomputation, never a module nested in
another chosen one, then drops any choice the budget does not need. The hand-tuning rule "checkpoint
every N-th layer" is ``every_n_baseline``, and its whole decision order ``hand_tuning_baseline``, kept to
compare against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from memdoctor.cards import CARDS
from memdoctor.plan.checkpoints import with_checkpoints
from memdoctor.plan.config import Config
from memdoctor.plan.model import Prediction
from memdoctor.plan.padding import PAD_MULTIPLE
from memdoctor.plan.parallel import GPU_COUNTS, splits_over
from memdoctor.plan.target import (
    DEFAULT_PRIORITY,
    SAFETY_MARGIN,
    Target,
    cost,
    fits,
    known_oom,
    not_runnable,
    predict_for,
    runnable,
)
from memdoctor.plan.tiers import tier_one, tier_two
from memdoctor.plan.workload import Workload
from memdoctor.units import format_bytes

# GradScaler growth_interval: torch's default where the measured window of loss scales is wide; a
# shorter one (500, a common hand-tuned value) where it is narrow, so that after a back-off (the scale
# halves on an overflow) the scale climbs back out of the underflow side sooner. A heuristic, labelled.
NARROW_SCALE_WINDOW_LOG2 = 4
GROWTH_INTERVAL_WIDE = 2000
GROWTH_INTERVAL_NARROW = 500


@dataclass
class Plan:
    """The planner's answer: the chosen prediction (None when nothing fits) and what it looked at."""

    target: Target
    baseline: Prediction
    chosen: Prediction | None
    closest: Prediction  # the lowest predicted peak tried, for "nothing fits"
    fits_as_is: bool
    measured_peak_bytes: int = 0
    advice: list[str] = field(default_factory=list)
    reason: str | None = None  # why no plan could be made at all
    grad_scaler: dict[str, Any] | None = None  # for an fp16 plan: settings from the measured ranges
    avoided: str | None = None  # the lever family left out of the search (``make_plan``'s ``avoid``)
    excluded: tuple[str, ...] = ()  # families ``memdoctor run`` refused for this script (``exclude``)

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    def as_dict(self) -> dict[str, Any]:
        pick = self.chosen or self.closest
        return {
            "budget_bytes": self.target.budget_bytes,
            "limit_bytes": self.target.limit_bytes,
            "safety_margin": self.target.margin,
            "card": self.target.card.name if self.target.card else None,
            "gpus": self.target.gpus,
            "fits": self.fits,
            "fits_as_is": self.fits_as_is,
            "measured_peak_bytes": self.measured_peak_bytes,
            "as_is_predicted_peak_bytes": self.baseline.peak_bytes,
            "predicted_peak_bytes": pick.peak_bytes,
            "predicted_reserved_bytes": pick.reserved_bytes,
            "predicted_step_time_ratio": pick.as_dict()["predicted_step_time_ratio"],
            "config": pick.config.as_dict(),
            "levers": pick.config.levers(),
            "prediction": pick.as_dict(),
            "advice": list(self.advice),
            "reason": self.reason,
            "grad_scaler": self.grad_scaler if pick.config.precision == "fp16" else None,
            "avoided": self.avoided,
            "excluded": list(self.excluded),
        }


def make_plan(
    w: Workload,
    target: Target,
    priority: Sequence[str] | None = None,
    avoid: str | None = None,
    exclude: Collection[str] = (),
) -> Plan:
    """The least-slowdown config that fits ``target``; the closest one and advice when none does.
    ``priority``: the lever families in the order the workload's nine-grid cell ranks them (ties in
    predicted time go to the config whose levers rank first; ``DEFAULT_PRIORITY`` without a cell).
    ``avoid``: a lever family left out of the search (``COMPARED_FAMILIES``: ``--verify`` measures the
    best plan without the chosen plan's costliest-to-predict lever, ``runner_up``). ``exclude``: lever
    families (``Config.families``) left out because ``memdoctor run`` refused them for this script (a
    ``--verify`` round): unlike ``avoid``, a fact about the script, not a comparison."""
    excluded = tuple(sorted(set(exclude)))
    left_out = frozenset(excluded) | ({avoid} if avoid else frozenset())
    plan = _search(w, target, priority, left_out)
    plan.avoided = avoid
    plan.excluded = excluded
    return plan


def _search(w: Workload, target: Target, priority: Sequence[str] | None, avoid: frozenset[str]) -> Plan:
    base = predict_for(w, Config(), target)
    if target.gpus == 1 and fits(base, target) and not known_oom(w, base.config, target):
        return Plan(target, base, base, base, True, w.peak_bytes)
    if not splits_over(w, target.gpus):
        why = (
            f"the measured batch of {w.batch_size} samples cannot be split over {target.gpus} GPUs "
            "(each rank needs at least one sample)"
        )
        return Plan(target, base, None, base, False, w.peak_bytes, [why], reason=why)
    order = list(priority or DEFAULT_PRIORITY)
    tried: list[Prediction] = []
    # A fitting config ``memdoctor run`` cannot apply to this script (the 8-bit optimizer: the script
    # builds its own) is never the plan: it becomes advice, with what the script must change.
    advisory: list[Prediction] = []
    for tier in (tier_one(w, target), tier_two(w, target)):
        tier = [c for c in tier if avoid.isdisjoint(c.families())]
        found = [
            p
            for p in (with_checkpoints(w, c, target, "checkpoint" not in avoid) for c in tier)
            if p is not None
        ]
        tried += found
        fitting = [p for p in found if fits(p, target) and not known_oom(w, p.config, target)]
        advisory += [p for p in fitting if not runnable(p.config)]
        fitting = [p for p in fitting if runnable(p.config)]
        if fitting:
            best = min(_preferred(fitting), key=lambda p: cost(p, order))
            caveats = _caveats(w, best)
            return Plan(target, base, best, best, False, w.peak_bytes, caveats, grad_scaler=grad_scaler(w))
    closest = min([p for p in tried if runnable(p.config)] or [base], key=lambda p: p.reserved_bytes)
    advice = what_would_fit(w, target, closest)
    if advisory:
        best = min(advisory, key=lambda p: cost(p, order))
        advice.insert(1, f"{not_runnable(best.config)} ({format_bytes(best.reserved_bytes)} predicted)")
    return Plan(target, base, None, closest, False, w.peak_bytes, advice, grad_scaler=grad_scaler(w))


# The lever families whose time the model predicts least well, and that most often trade against each
# other: micro-batching costs a fixed time per micro-batch that the model takes as a share of the step
# (on the H200 under bf16 it was far more: ViT-base in Lightning, bf16 + accumulate 2 at 1.84x the step
# of bf16 alone, BENCHMARKS.md), and recomputation's cost depends on where the checkpointed modules'
# forward time went. ``--verify`` measures the best plan without the chosen plan's one (``runner_up``).
COMPARED_FAMILIES = ("accumulation", "checkpoint")


# The compared plan is searched with half the safety margin: it is measured before anyone applies it,
# and becomes the plan only if the measured run fits and is faster (the margin absorbs prediction
# error; here a measurement checks the prediction). The model over-predicted GPT-2's checkpointed
# plans under bf16 (7.01 GiB allocated predicted, 6.46 measured for every block checkpointed), so that
# with the full margin the plan without micro-batching it found offloaded the optimizer as well; with
# none, BERT's (bf16 alone, parameter offload, 7.93 GiB predicted of 8) ran out of memory.
COMPARED_MARGIN = SAFETY_MARGIN / 2


def compared_family(config: Config) -> str | None:
    """The family ``runner_up`` leaves out for ``config``: the first of ``COMPARED_FAMILIES`` it uses."""
    used = config.families()
    return next((f for f in COMPARED_FAMILIES if f in used), None)


def runner_up(
    w: Workload,
    target: Target,
    plan: Plan,
    priority: Sequence[str] | None = None,
    exclude: Collection[str] = (),
) -> Plan | None:
    """The best plan without the chosen plan's ``compared_family`` that ``memdoctor run`` can apply and
    that is predicted to fit the budget with half the safety margin (``COMPARED_MARGIN``); None
    when there is no such family or no such plan."""
    if plan.chosen is None or plan.fits_as_is:
        return None
    family = compared_family(plan.chosen.config)
    if family is None:
        return None
    other = compared_plan(w, target, family, priority, exclude)
    same = other is not None and other.chosen is not None and other.chosen.config == plan.chosen.config
    return None if same else other


def compared_plan(
    w: Workload,
    target: Target,
    family: str,
    priority: Sequence[str] | None = None,
    exclude: Collection[str] = (),
) -> Plan | None:
    """The best plan without lever ``family`` (nor the ``exclude`` families), searched with
    ``COMPARED_MARGIN``, that ``memdoctor run`` can apply; None when none fits."""
    searched = dataclasses.replace(target, margin=COMPARED_MARGIN)
    other = make_plan(w, searched, priority, avoid=family, exclude=exclude)
    return other if other.chosen is not None else None


def _preferred(fitting: list[Prediction]) -> list[Prediction]:
    """The fitting configs the choice is made among (all of them ones ``memdoctor run`` can apply): one
    that keeps the optimizer on the GPU beats one that offloads it, because the time model does not count
    the CPU optimizer step (only the copies; full offload's host step is counted, but as an assumption)."""
    on_gpu = [p for p in fitting if p.config.optimizer == "as-is" and not p.config.full_offload]
    return on_gpu or fitting


def grad_scaler(w: Workload) -> dict[str, Any] | None:
    """GradScaler settings for an fp16 plan from the precision section's measured scale window:
    ``init_scale`` = 2**(its suggested log2 scale), ``growth_interval`` by the window's width (see
    ``NARROW_SCALE_WINDOW_LOG2``); None when the gradient ranges were not measured."""
    if w.scale_window_log2 is None or w.suggested_scale_log2 is None:
        return None
    (lo, hi), init = w.scale_window_log2, w.suggested_scale_log2
    narrow = hi - lo < NARROW_SCALE_WINDOW_LOG2
    interval = GROWTH_INTERVAL_NARROW if narrow else GROWTH_INTERVAL_WIDE
    return {
        "init_scale": float(2**init),
        "growth_interval": interval,
        "basis": (
            f"measured gradient ranges fit loss scales 2^{lo} to 2^{hi}: init_scale 2^{init}; a "
            f"{'narrow' if narrow else 'wide'} window, so growth_interval {interval} (a heuristic)"
        ),
    }


def _caveats(w: Workload, p: Prediction) -> list[str]:
    out = []
    if not w.complete:
        out.append(
            "the profiled step died before it finished, so modules that had not run are missing from the "
            "ledger: re-profile at the planned micro-batch to confirm"
        )
    if p.config.accumulation_steps > 1:
        out.append(
            f"keep the effective batch: accumulate gradients over {p.config.accumulation_steps} micro-batches"
        )
    return out


def what_would_fit(w: Workload, target: Target, closest: Prediction) -> list[str]:
    """Plain advice when nothing fits: how far off the best config is, and what else would do it."""
    short = closest.reserved_bytes - target.limit_bytes
    out = [
        f"nothing modelled fits: the closest config ({', '.join(closest.config.levers()) or 'as profiled'}) "
        f"needs {format_bytes(closest.reserved_bytes)}, {format_bytes(short)} over the "
        f"{format_bytes(target.limit_bytes)} the budget allows after the {target.margin:.0%} margin"
    ]
    state = w.parameters + w.gradients + w.optimizer_state
    if target.gpus > 1:
        out[0] = out[0].replace("nothing modelled fits", f"nothing modelled fits on {target.gpus} GPUs", 1)
        state = state // target.gpus  # a rank's share under FSDP2
    if state >= target.limit_bytes and not target.offloads(w):
        out.append(
            f"parameters, gradients and optimizer state alone take {format_bytes(state)}: more memory is "
            "needed (on a CPU run, offloading to host memory frees none: it is the same memory)"
        )
    elif state >= target.limit_bytes:
        out.append(
            f"parameters, gradients and optimizer state alone take {format_bytes(state)}: a bigger card, "
            "or full offload (full_offload: FSDP2 with CPU offload) with smaller activations, is needed"
        )
    bigger = [c for c in CARDS if c.usable_bytes * (1 - target.margin) >= closest.reserved_bytes]
    if bigger:
        out.append(f"the smallest listed card that holds that config: {bigger[0].name}")
    truncated = truncation_alternative(w, target)
    if truncated is not None:
        out.append(
            f"an alternative that changes the data: {', '.join(truncated.config.levers())} would fit "
            f"({format_bytes(truncated.reserved_bytes)} predicted)"
        )
    out.append(
        "a shorter sequence length shrinks activations at least in proportion "
        "(attention scores with its square)"
    )
    return out


def truncation_alternative(w: Workload, target: Target) -> Prediction | None:
    """The fastest fitting config that truncates sequences to a length percentile (p99, else p90) on
    top of the search's levers: it changes the data, so it is only offered as an alternative, labelled,
    never as the plan. None without measured lengths or when no percentile fits either."""
    if w.padding is None:
        return None
    for policy in ("p99", "p90"):
        if policy not in w.padding.percentiles:
            continue
        configs = [
            dataclasses.replace(c, padding=policy, pad_to_multiple_of=PAD_MULTIPLE)
            for c in tier_one(w, target) + tier_two(w, target)
            if c.padding == "as-is"
        ]
        found = [p for p in (with_checkpoints(w, c, target) for c in configs) if p is not None]
        fitting = [p for p in found if fits(p, target)]
        if fitting:
            return min(fitting, key=cost)
    return None


def gpus_needed(w: Workload, target: Target, priority: Sequence[str] | None = None) -> Plan | None:
    """The plan on the fewest cards like ``target``'s, more than its ``gpus``, that fits (of
    ``GPU_COUNTS``, as many as the measured batch can be split over); None when none does. The largest
    count is tried first: when it does not fit, no smaller one does (a rank's share only shrinks)."""
    counts = [m for m in GPU_COUNTS if m > target.gpus and splits_over(w, m)]
    if not counts or not make_plan(w, dataclasses.replace(target, gpus=counts[-1]), priority).fits:
        return None
    for m in counts:
        plan = make_plan(w, dataclasses.replace(target, gpus=m), priority)
        if plan.fits:
            return plan
    return None


def needed_words(target: Target, found: Plan | None, w: Workload) -> str:
    """One sentence: how many cards like ``target``'s the plan needs, when its ``gpus`` are not enough."""
    have = f"{target.gpus} GPU{'s' if target.gpus > 1 else ''}"
    if found is None:
        most = max((m for m in GPU_COUNTS if splits_over(w, m)), default=target.gpus)
        verb = "are" if target.gpus > 1 else "is"
        return f"{have} {verb} not enough, and no plan on up to {most} fits either"
    pick = found.chosen
    assert pick is not None
    ratio = pick.as_dict()["predicted_step_time_ratio"]
    speed = f", step time x{ratio:.2f} of the profiled one" if ratio is not None else ""
    return (
        f"{have} {'are' if target.gpus > 1 else 'is'} not enough: {found.target.gpus} are, with "
        f"{'; '.join(pick.config.levers())} ({format_bytes(pick.reserved_bytes)} predicted per card{speed})"
    )


def card_table(
    w: Workload, margin: float = SAFETY_MARGIN, priority: Sequence[str] | None = None, gpus: int = 1
) -> list[dict[str, Any]]:
    """ "Which cards, and how many": for every listed card, fits as-is / fits with a plan / does not fit
    on ``gpus`` of them, and where it does not, the fewest that do (``gpus_needed``)."""
    rows = []
    for card in CARDS:
        target = Target(card.usable_bytes, card, margin, gpus)
        plan = make_plan(w, target, priority)
        verdict = "fits as-is" if plan.fits_as_is else "fits with plan" if plan.fits else "does not fit"
        pick = plan.chosen or plan.closest
        rows.append(
            {
                "card": card.name,
                "gpu": card.key,  # what --gpu takes
                "memory_bytes": card.memory_bytes,
                "usable_bytes": card.usable_bytes,
                "bf16": card.bf16,
                "pcie_gen": card.pcie_gen,
                "capability": list(card.capability),
                "verdict": verdict,
                "levers": pick.config.levers() if plan.fits and not plan.fits_as_is else [],
                "predicted_reserved_bytes": pick.reserved_bytes,
                "predicted_step_time_ratio": pick.as_dict()["predicted_step_time_ratio"],
                "gpus": gpus,
                "gpus_needed": None if plan.fits else needed_row(gpus_needed(w, target, priority)),
            }
        )
    return rows


def needed_row(found: Plan | None) -> dict[str, Any] | None:
    """The card table's ``gpus_needed``: the count and its plan, or None when no count fits."""
    if found is None or found.chosen is None:
        return None
    return {
        "gpus": found.target.gpus,
        "levers": found.chosen.config.levers(),
        "predicted_reserved_bytes": found.chosen.reserved_bytes,
        "predicted_step_time_ratio": found.chosen.as_dict()["predicted_step_time_ratio"],
    }
