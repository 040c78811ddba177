"""The planner: for a budget, the config that fits with a safety margin at the least predicted slowdown.

Search, in two tiers, following the story's decision order (memory levers first, numerics last):

1. levers that keep the numerics: activation checkpointing, micro-batch with gradient accumulation,
   optimizer state offload, and (where the trace measured what they act on) trimming padding to the
   longest sequence, memory-efficient attention, expandable segments, parameter offload;
2. only when tier 1 finds nothing: also autocast (bf16 where the card has it, fp16 only where the
   trace's precision verdict says fp16 is safe) and an 8-bit optimizer.

For every combination of the non-checkpoint levers, ``choose_checkpoints`` picks *which* modules to
checkpoint: greedily by measured bytes freed per millisecond of recomputation, never a module nested in
another chosen one, then drops any choice the budget does not need. The story's "every N-th layer" rule
is ``every_n_baseline``, and its whole decision order ``story_baseline``, kept to compare against.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memdoctor.analysis.layers import repeated_blocks
from memdoctor.cards import CARDS, Card
from memdoctor.plan.model import (
    PAD_MULTIPLE,
    Candidate,
    Config,
    Prediction,
    Workload,
    activation_scale,
    checkpointed_gradients,
    offloaded_state,
    predict,
    reserved_ratio,
    step_floor,
)
from memdoctor.plan.ninegrid import lever_priority
from memdoctor.trace import Trace
from memdoctor.units import format_bytes

SAFETY_MARGIN = 0.10  # a plan must leave this share of the budget free
ACCUMULATIONS = (1, 2, 4, 8)
# GradScaler growth_interval: torch's default where the measured window of loss scales is wide; a
# shorter one (the story's 500) where it is narrow, so that after a back-off (the scale halves on an
# overflow) the scale climbs back out of the underflow side sooner. A heuristic, labelled.
NARROW_SCALE_WINDOW_LOG2 = 4
GROWTH_INTERVAL_WIDE = 2000
GROWTH_INTERVAL_NARROW = 500
# The lever order where no nine-grid cell is known (the story's: checkpointing or offload, then
# dynamic batching, then mixed precision); ``make_plan`` takes the cell's order.
DEFAULT_PRIORITY = tuple(lever_priority(None))


@dataclass
class Target:
    """What the plan must fit: a byte budget, and the card's traits when one is named."""

    budget_bytes: int
    card: Card | None = None
    margin: float = SAFETY_MARGIN

    @property
    def limit_bytes(self) -> int:
        return int(self.budget_bytes * (1.0 - self.margin))

    def bf16(self, w: Workload) -> bool | None:
        return self.card.bf16 if self.card else w.bf16_native

    def link(self, w: Workload) -> float | None:
        return self.card.pcie_bytes_per_s if self.card else w.offload_bytes_per_s

    def card_name(self) -> str | None:
        return self.card.name if self.card else None


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
        }


def fits(p: Prediction, target: Target) -> bool:
    return p.reserved_bytes <= target.limit_bytes


# ----------------------------------------------------------------------------------------- search


def make_plan(
    w: Workload, target: Target, priority: Sequence[str] | None = None, avoid: str | None = None
) -> Plan:
    """The least-slowdown config that fits ``target``; the closest one and advice when none does.
    ``priority``: the lever families in the order the workload's nine-grid cell ranks them (ties in
    predicted time go to the config whose levers rank first; ``DEFAULT_PRIORITY`` without a cell).
    ``avoid``: a lever family left out of the search (``COMPARED_FAMILIES``: ``--verify`` measures the
    best plan without the chosen plan's costliest-to-predict lever, ``runner_up``)."""
    plan = _search(w, target, priority, avoid)
    plan.avoided = avoid
    return plan


def _search(w: Workload, target: Target, priority: Sequence[str] | None, avoid: str | None) -> Plan:
    base = _predict(w, Config(), target)
    if fits(base, target) and not known_oom(w, base.config, target):
        return Plan(target, base, base, base, True, w.peak_bytes)
    order = list(priority or DEFAULT_PRIORITY)
    tried: list[Prediction] = []
    for tier in (_tier_one(w, target), _tier_two(w, target)):
        tier = [c for c in tier if not (avoid == "accumulation" and c.accumulation > 1)]
        found = [
            p for p in (_with_checkpoints(w, c, target, avoid != "checkpoint") for c in tier) if p is not None
        ]
        tried += found
        fitting = [p for p in found if fits(p, target) and not known_oom(w, p.config, target)]
        if fitting:
            best = min(_preferred(fitting), key=lambda p: _cost(p, order))
            caveats = _caveats(w, best) + ([] if runnable(best.config) else [not_runnable(best.config)])
            return Plan(target, base, best, best, False, w.peak_bytes, caveats, grad_scaler=grad_scaler(w))
    closest = min(tried or [base], key=lambda p: p.reserved_bytes)
    advice = what_would_fit(w, target, closest)
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


def runner_up(w: Workload, target: Target, plan: Plan, priority: Sequence[str] | None = None) -> Plan | None:
    """The best plan without the chosen plan's ``compared_family`` that ``memdoctor run`` can apply and
    that is predicted to fit the budget with half the safety margin (``COMPARED_MARGIN``); None
    when there is no such family or no such plan."""
    if plan.chosen is None or plan.fits_as_is:
        return None
    family = compared_family(plan.chosen.config)
    if family is None:
        return None
    other = compared_plan(w, target, family, priority)
    same = other is not None and other.chosen is not None and other.chosen.config == plan.chosen.config
    return None if same else other


def compared_plan(
    w: Workload, target: Target, family: str, priority: Sequence[str] | None = None
) -> Plan | None:
    """The best plan without lever ``family``, searched with ``COMPARED_MARGIN``, that ``memdoctor run``
    can apply; None when none fits."""
    other = make_plan(w, dataclasses.replace(target, margin=COMPARED_MARGIN), priority, avoid=family)
    return other if other.chosen is not None and runnable(other.chosen.config) else None


def known_oom(w: Workload, config: Config, target: Target) -> bool:
    """Was ``config`` measured running out of memory under ``target``'s budget or more? The unchanged
    config, when the script as it is died under that budget (its workload then comes from a re-profile
    at a smaller micro-batch, whose scaled prediction could say otherwise)."""
    oom = w.as_is_oom_budget
    return config == Config() and oom is not None and target.budget_bytes <= oom


def runnable(config: Config) -> bool:
    """Whether ``memdoctor run`` applies every lever of ``config`` (memdoctor/runtime): everything but
    swapping the script's optimizer for an 8-bit one (bitsandbytes is an optional dependency)."""
    return config.optimizer != "8bit"


def not_runnable(config: Config) -> str:
    return (
        f"memdoctor run cannot apply optimizer: {config.optimizer}: only this plan fits; build the "
        "script's optimizer as bitsandbytes' AdamW8bit"
    )


def _preferred(fitting: list[Prediction]) -> list[Prediction]:
    """The fitting configs the choice is made among: a plan ``memdoctor run`` can apply beats a faster one
    it cannot (it would be advice only), and one that keeps the optimizer on the GPU beats one that
    offloads it, because the time model does not count the CPU optimizer step (only the copies)."""
    runs = [p for p in fitting if runnable(p.config)]
    on_gpu = [p for p in runs if p.config.optimizer == "as-is"]
    return on_gpu or runs or fitting


def _predict(w: Workload, config: Config, target: Target) -> Prediction:
    return predict(
        w, config, bf16=target.bf16(w), offload_bytes_per_s=target.link(w), card_name=target.card_name()
    )


def _cost(p: Prediction, order: Sequence[str] = DEFAULT_PRIORITY) -> tuple[float, int, tuple[int, ...]]:
    """Rank: the predicted extra time (unknown costs count as large), then the number of levers, then
    the lever families by the nine-grid cell's priority (of two configs as fast and as simple, the one
    whose best-ranked lever comes first in ``order`` wins)."""
    extra = p.extra_ms if p.extra_ms is not None else float("inf")
    if p.extra_ms is None:  # rank by the part that is known, after every fully known config
        extra = 1e9 + sum(v for v in p.time_parts.values() if v is not None)
    ranks = tuple(sorted(_rank(f, order) for f in p.config.families()))
    return (round(extra, 6), len(p.config.levers()), ranks)


def _rank(family: str, order: Sequence[str]) -> int:
    return order.index(family) if family in order else len(order)


def _free_levers(w: Workload) -> list[dict[str, Any]]:
    """Combinations of the levers that keep the numerics and the data and cost no time (or save some):
    trimming padding to the longest sequence (only where that lowers the peak — the longest batch seen
    is shorter than the padded length — and the mean batch gets ``TRIM_MIN_SAVING`` shorter: batches
    that change shape cost time; a smaller saving is the ``dynamic_padding`` finding's),
    memory-efficient attention, expandable segments, and parameter offload of the largest, least
    compute-heavy holders; each only where the trace measured what it acts on."""
    trims = (
        w.padding is not None
        and w.padding.ratio("longest", PAD_MULTIPLE) < 1.0
        and w.padding.worth_trimming()
    )
    paddings = [("as-is", 1)] + ([("longest", PAD_MULTIPLE)] if trims else [])
    attention = ["as-is"] + (["sdpa"] if w.attention_temporaries > 0 else [])
    allocator = ["as-is"] + (["expandable"] if w.reserved_ratio > 1.0 else [])
    names = [h.name for h in w.param_holders]
    offload = [tuple(names[:k]) for k in range(len(names) + 1)]
    return [
        {"padding": p, "pad_multiple": m, "attention": a, "allocator": al, "offload": o}
        for (p, m), a, al, o in itertools.product(paddings, attention, allocator, offload)
    ]


def _tier_one(w: Workload, target: Target) -> list[Config]:
    """Levers that keep the script's numbers, and bf16 autocast where the target card runs it natively:
    bf16 keeps fp32's exponent range (no loss scaling, no overflow: the precision section's overflow and
    underflow risks are fp16's), and on such a card it is the fastest lever there is. The story ran the
    search with every precision change last; on the H200 that left bf16's 4x on the table
    (BENCHMARKS.md, the story's scenario). The numerics-preserving alternative stays in the report."""
    precisions = ["fp32"] + (["bf16"] if target.bf16(w) else [])
    return [
        Config(accumulation=a, precision=p, optimizer=o, **extra)
        for a in _accumulations(w)
        for p in precisions
        for o in ("as-is", "offload")
        for extra in _free_levers(w)
    ]


def _tier_two(w: Workload, target: Target) -> list[Config]:
    """Only when nothing in tier one fits: fp16 (where the measured ranges make it safe and the card has
    no bf16) and the 8-bit optimizer."""
    precisions = ["fp32"] + (["bf16"] if target.bf16(w) else [])
    if w.precision_verdict == "fp16_safe" and not target.bf16(w):
        precisions.append("fp16")
    combos = itertools.product(_accumulations(w), precisions, ("as-is", "8bit", "offload"), _free_levers(w))
    return [
        Config(accumulation=a, precision=p, optimizer=o, **extra)
        for a, p, o, extra in combos
        if p == "fp16" or o == "8bit"
    ]


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


def _accumulations(w: Workload) -> list[int]:
    """Micro-batch splits to try; only divisors of the batch when its size was measured."""
    return [a for a in ACCUMULATIONS if w.batch_size is None or (w.batch_size % a == 0 and w.batch_size >= a)]


def _with_checkpoints(w: Workload, config: Config, target: Target, allowed: bool = True) -> Prediction | None:
    """``config`` as is when it fits (or checkpoints are not ``allowed``), else with the checkpoints that
    make it fit (None: none do)."""
    p = _predict(w, config, target)
    if fits(p, target) or not allowed:
        return p
    chosen = choose_checkpoints(w, config, target)
    if not chosen:
        return p
    return _predict(w, _checkpointed(config, chosen), target)


def _checkpointed(config: Config, chosen: list[Candidate]) -> Config:
    return dataclasses.replace(config, checkpoint=tuple(c.name for c in chosen))


def choose_checkpoints(w: Workload, config: Config, target: Target) -> list[Candidate]:
    """Modules to checkpoint so that ``config`` fits; empty when no choice does.

    Checkpointing a set frees the sum of its modules' ``checkpoint_free_bytes`` but brings the largest
    one back while it is recomputed, so the net saving is ``sum - max``. For every cap on the largest
    module, the modules under the cap are taken greedily by bytes freed per ms of recomputation (none
    nested in another taken one) until the net saving is enough; choices the fit does not need are then
    dropped, least efficient first. The cap whose choice recomputes the fewest ms wins."""
    need = _needed_saving(w, config, target)
    if need is None:
        return []
    best: list[Candidate] = []
    for cap in sorted({c.free_bytes for c in w.candidates}):
        pool = [c for c in w.candidates if c.free_bytes <= cap]
        for order in GREEDY_ORDERS:
            picked = _greedy(pool, need, order)
            if picked and (not best or _ms(picked) < _ms(best)):
                best = picked
    if best and not fits(_predict(w, _checkpointed(config, best), target), target):
        return []  # the linear estimate was off by rounding: say nothing fits rather than guess
    return best


def _reserved(p: Prediction) -> int:
    return p.reserved_bytes


def _needed_saving(w: Workload, config: Config, target: Target) -> float | None:
    """Net activation bytes (as measured, before micro-batch and autocast scaling) that checkpointing
    must free for ``config`` to fit; None when even no activations at all would not fit."""
    p0 = _predict(w, config, target)
    parts = dict(p0.breakdown)
    # Count as ``predict`` does for the checkpointed config: its gradients (a share of them with
    # checkpointing alone), its allocator slack, the optimizer step's own peak.
    _, grads = offloaded_state(w, config, [])
    parts["gradients"] = checkpointed_gradients(grads, config)
    rest = sum(parts.values()) - parts["activations"]
    floor = step_floor(w, config, parts, [])
    allowed = target.limit_bytes / reserved_ratio(w, dataclasses.replace(config, checkpoint=("",)))
    room = allowed - rest
    if room <= 0 or floor > allowed:
        return None
    scale = activation_scale(w, config)
    return max(0.0, (p0.breakdown["activations"] - room) / scale) + 1.0


# Greedy orders: by bytes freed per ms of recomputation (cheap sub-blocks first), and by bytes freed
# (whole blocks first: taking sub-blocks rules out their blocks, which can leave a large need unmet).
GREEDY_ORDERS: tuple[Callable[[Candidate], float], ...] = (
    lambda c: -c.bytes_per_ms,
    lambda c: -c.free_bytes,
)


def _greedy(
    pool: list[Candidate], need: float, order: Callable[[Candidate], float] = GREEDY_ORDERS[0]
) -> list[Candidate]:
    # Running sets and sums instead of rescanning ``chosen`` per candidate: choose_checkpoints calls this
    # once per cap, so on a model with a thousand candidates a rescan made the search cubic (minutes).
    chosen: list[Candidate] = []
    taken: set[tuple[int, int]] = set()
    nesting: set[tuple[int, int]] = set()  # ancestors of the chosen: a module that holds one of them
    total = largest = 0
    for c in sorted(pool, key=order):
        if c.key in taken or c.key in nesting or not c.ancestors.isdisjoint(taken):
            continue
        chosen.append(c)
        taken.add(c.key)
        nesting |= c.ancestors
        total, largest = total + c.free_bytes, max(largest, c.free_bytes)
        if total - largest >= need:
            return _prune(chosen, need)
    return []


def _net(chosen: list[Candidate]) -> int:
    return sum(c.free_bytes for c in chosen) - max((c.free_bytes for c in chosen), default=0)


def _ms(chosen: list[Candidate]) -> float:
    return sum(c.forward_ms for c in chosen)


def _prune(chosen: list[Candidate], need: float) -> list[Candidate]:
    for c in sorted(chosen, key=lambda c: c.bytes_per_ms):
        rest = [o for o in chosen if o is not c]
        if rest and _net(rest) >= need:
            chosen = rest
    return chosen


# ----------------------------------------------------------------------------------------- alternatives

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
    keep = [p for p in (_with_checkpoints(w, c, target) for c in _tier_one(w, target)) if p is not None]
    more = [p for p in (_with_checkpoints(w, c, target) for c in _tier_two(w, target)) if p is not None]
    every = [plan.baseline, *keep, *more]
    fitting = [p for p in every if fits(p, target)]
    same = [p for p in [plan.baseline, *keep] if fits(p, target) and p.config.precision == "fp32"]
    picks = {
        "chosen": plan.chosen,
        "fastest": min(fitting, key=_cost, default=None),
        "least_memory": min(every, key=lambda p: p.reserved_bytes),
        "numerics_preserving": min(same, key=_cost, default=None)
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


# ----------------------------------------------------------------------------------------- baseline


def every_n_baseline(
    trace: Trace, w: Workload, target: Target, config: Config | None = None
) -> Prediction | None:
    """The story's rule: checkpoint every N-th block of the model's largest stack of repeated blocks,
    with the largest N that fits (fewest blocks); None when even every block does not fit."""
    config = config or Config()
    stack = block_stack(trace, w)
    for n in range(len(stack), 0, -1):
        picked = stack[::n]
        p = _predict(w, _checkpointed(config, picked), target)
        if fits(p, target):
            return p
    return None


def story_baseline(trace: Trace, w: Workload, target: Target) -> Prediction | None:
    """The story's decision order, the baseline the search must beat. Not enough memory: is the step
    compute-bound (compute class high or medium, or not measured)? Then checkpoint every N-th block
    (``every_n_baseline``: the largest N that fits) at every later stage too; else offload (the
    embedding/head parameters and the optimizer state). Then dynamic batching: trim padding to the
    longest sequence, then halve the micro-batch (gradient accumulation 2, 4, 8). Then mixed
    precision: bf16 where the card has it, else fp16 where the precision verdict allows. Each stage
    keeps the levers of the ones before; the first config that fits is returned, None when none does."""
    base = _predict(w, Config(), target)
    if fits(base, target) and not known_oom(w, base.config, target):
        return base
    checkpointing = w.compute_class != "low"
    for config in _story_stages(w, target, checkpointing):
        p = every_n_baseline(trace, w, target, config) if checkpointing else _predict(w, config, target)
        if p is None and checkpointing and not block_stack(trace, w):
            p = _predict(w, config, target)  # no repeated blocks to checkpoint
        if p is not None and fits(p, target):
            return p
    return None


def _story_stages(w: Workload, target: Target, checkpointing: bool) -> list[Config]:
    """The cumulative configs of the story's order (checkpoints are chosen per stage by the caller)."""
    holders = tuple(h.name for h in w.param_holders)
    config = Config() if checkpointing else Config(optimizer="offload", offload=holders)
    stages = [config]
    if w.padding is not None:
        config = dataclasses.replace(config, padding="longest", pad_multiple=PAD_MULTIPLE)
        stages.append(config)
    for a in _accumulations(w)[1:]:
        config = dataclasses.replace(config, accumulation=a)
        stages.append(config)
    precision = "bf16" if target.bf16(w) else "fp16" if w.precision_verdict == "fp16_safe" else None
    if precision:
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


# ----------------------------------------------------------------------------------------- advice


def _caveats(w: Workload, p: Prediction) -> list[str]:
    out = []
    if not w.complete:
        out.append(
            "the profiled step died before it finished, so modules that had not run are missing from the "
            "ledger: re-profile at the planned micro-batch to confirm"
        )
    if p.config.accumulation > 1:
        out.append(
            f"keep the effective batch: accumulate gradients over {p.config.accumulation} micro-batches"
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
    if state >= target.limit_bytes:
        out.append(
            f"parameters, gradients and optimizer state alone take {format_bytes(state)}: a bigger card, "
            "parameter offload or sharding (not modelled yet) is needed"
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
            dataclasses.replace(c, padding=policy, pad_multiple=PAD_MULTIPLE)
            for c in _tier_one(w, target) + _tier_two(w, target)
            if c.padding == "as-is"
        ]
        found = [p for p in (_with_checkpoints(w, c, target) for c in configs) if p is not None]
        fitting = [p for p in found if fits(p, target)]
        if fitting:
            return min(fitting, key=_cost)
    return None


def card_table(
    w: Workload, margin: float = SAFETY_MARGIN, priority: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """ "Which card do I need": for every listed card, fits as-is / fits with a plan / does not fit."""
    rows = []
    for card in CARDS:
        plan = make_plan(w, Target(card.usable_bytes, card, margin), priority)
        verdict = "fits as-is" if plan.fits_as_is else "fits with plan" if plan.fits else "does not fit"
        pick = plan.chosen or plan.closest
        rows.append(
            {
                "card": card.name,
                "memory_bytes": card.memory_bytes,
                "usable_bytes": card.usable_bytes,
                "bf16": card.bf16,
                "pcie_gen": card.pcie_gen,
                "capability": list(card.capability),
                "verdict": verdict,
                "levers": pick.config.levers() if plan.fits and not plan.fits_as_is else [],
                "predicted_reserved_bytes": pick.reserved_bytes,
                "predicted_step_time_ratio": pick.as_dict()["predicted_step_time_ratio"],
            }
        )
    return rows
