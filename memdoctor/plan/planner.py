"""The planner: for a budget, the config that fits with a safety margin at the least predicted slowdown.

Search, in two tiers, following the story's decision order (memory levers first, numerics last):

1. levers that keep the numerics: activation checkpointing, micro-batch with gradient accumulation,
   optimizer state offload;
2. only when tier 1 finds nothing: also autocast (bf16 where the card has it, fp16 only where the
   trace's precision verdict says fp16 is safe) and an 8-bit optimizer.

For every combination of the non-checkpoint levers, ``choose_checkpoints`` picks *which* modules to
checkpoint: greedily by measured bytes freed per millisecond of recomputation, never a module nested in
another chosen one, then drops any choice the budget does not need. The story's "every N-th layer" rule
is ``every_n_baseline``, kept to compare against.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from memdoctor.analysis.summary import repeated_blocks
from memdoctor.plan.cards import CARDS, Card
from memdoctor.plan.model import Candidate, Config, Prediction, Workload, activation_scale, predict
from memdoctor.trace import Trace
from memdoctor.units import format_bytes

SAFETY_MARGIN = 0.10  # a plan must leave this share of the budget free
ACCUMULATIONS = (1, 2, 4, 8)


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
        }


def fits(p: Prediction, target: Target) -> bool:
    return p.reserved_bytes <= target.limit_bytes


# ----------------------------------------------------------------------------------------- search


def make_plan(w: Workload, target: Target) -> Plan:
    """The least-slowdown config that fits ``target``; the closest one and advice when none does."""
    base = _predict(w, Config(), target)
    if fits(base, target):
        return Plan(target, base, base, base, True, w.peak_bytes)
    tried: list[Prediction] = []
    for tier in (_tier_one(w), _tier_two(w, target)):
        found = [p for p in (_with_checkpoints(w, c, target) for c in tier) if p is not None]
        tried += found
        fitting = [p for p in found if fits(p, target)]
        if fitting:
            best = min(fitting, key=_cost)
            return Plan(target, base, best, best, False, w.peak_bytes, _caveats(w, best))
    closest = min(tried or [base], key=lambda p: p.reserved_bytes)
    return Plan(target, base, None, closest, False, w.peak_bytes, what_would_fit(w, target, closest))


def _predict(w: Workload, config: Config, target: Target) -> Prediction:
    return predict(w, config, bf16=target.bf16(w), offload_bytes_per_s=target.link(w))


def _cost(p: Prediction) -> tuple[float, int]:
    """Rank: the predicted extra time (unknown costs count as large), then the number of levers."""
    extra = p.extra_ms if p.extra_ms is not None else float("inf")
    if p.extra_ms is None:  # rank by the part that is known, after every fully known config
        extra = 1e9 + sum(v for v in p.time_parts.values() if v is not None)
    return (extra, len(p.config.levers()))


def _tier_one(w: Workload) -> list[Config]:
    return [Config(accumulation=a, optimizer=o) for a in _accumulations(w) for o in ("as-is", "offload")]


def _tier_two(w: Workload, target: Target) -> list[Config]:
    precisions = ["fp32"] + (["bf16"] if target.bf16(w) else [])
    if w.precision_verdict == "fp16_safe" and not target.bf16(w):
        precisions.append("fp16")
    combos = itertools.product(_accumulations(w), precisions, ("as-is", "8bit", "offload"))
    return [
        Config(accumulation=a, precision=p, optimizer=o) for a, p, o in combos if p != "fp32" or o == "8bit"
    ]


def _accumulations(w: Workload) -> list[int]:
    """Micro-batch splits to try; only divisors of the batch when its size was measured."""
    return [a for a in ACCUMULATIONS if w.batch_size is None or (w.batch_size % a == 0 and w.batch_size >= a)]


def _with_checkpoints(w: Workload, config: Config, target: Target) -> Prediction | None:
    """``config`` as is when it fits, else with the checkpoints that make it fit (None: none do)."""
    p = _predict(w, config, target)
    if fits(p, target):
        return p
    chosen = choose_checkpoints(w, config, target)
    if not chosen:
        return p
    return _predict(w, _checkpointed(config, chosen), target)


def _checkpointed(config: Config, chosen: list[Candidate]) -> Config:
    return Config(tuple(c.name for c in chosen), config.accumulation, config.precision, config.optimizer)


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
        picked = _greedy([c for c in w.candidates if c.free_bytes <= cap], need)
        if picked and (not best or _ms(picked) < _ms(best)):
            best = picked
    if best and not fits(_predict(w, _checkpointed(config, best), target), target):
        return []  # the linear estimate was off by rounding: say nothing fits rather than guess
    return best


def _needed_saving(w: Workload, config: Config, target: Target) -> float | None:
    """Net activation bytes (as measured, before micro-batch and autocast scaling) that checkpointing
    must free for ``config`` to fit; None when even no activations at all would not fit."""
    p0 = _predict(w, config, target)
    # checkpointed configs count every gradient (``predict``), the unchanged one only those at the peak
    rest = sum(p0.breakdown.values()) - p0.breakdown["activations"] - p0.breakdown["gradients"] + w.gradients
    floor = w.parameters + w.gradients + p0.breakdown["optimizer_state"] + w.fixed
    allowed = target.limit_bytes / w.reserved_ratio
    room = allowed - rest
    if room <= 0 or floor > allowed:
        return None
    scale = activation_scale(w, config)
    return max(0.0, (p0.breakdown["activations"] - room) / scale) + 1.0


def _greedy(pool: list[Candidate], need: float) -> list[Candidate]:
    # Running sets and sums instead of rescanning ``chosen`` per candidate: choose_checkpoints calls this
    # once per cap, so on a model with a thousand candidates a rescan made the search cubic (minutes).
    chosen: list[Candidate] = []
    taken: set[tuple[int, int]] = set()
    nesting: set[tuple[int, int]] = set()  # ancestors of the chosen: a module that holds one of them
    total = largest = 0
    for c in sorted(pool, key=lambda c: -c.bytes_per_ms):
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
    * ``fastest``: the fitting config with the least predicted slowdown (may use autocast, which
      ``chosen`` avoids while the numerics-preserving tier fits); null when nothing fits;
    * ``least_memory``: the lowest predicted reserved peak of every config evaluated, fitting or not;
    * ``numerics_preserving``: no autocast and no 8-bit optimizer: the fastest one that fits, else the
      one closest to fitting.

    Checkpoints are chosen per config only as far as the budget needs them, so ``least_memory`` is the
    least of what the search tried, not the least any config could reach."""
    keep = [p for p in (_with_checkpoints(w, c, target) for c in _tier_one(w)) if p is not None]
    more = [p for p in (_with_checkpoints(w, c, target) for c in _tier_two(w, target)) if p is not None]
    every = [plan.baseline, *keep, *more]
    fitting = [p for p in every if fits(p, target)]
    same = [p for p in [plan.baseline, *keep] if fits(p, target)]
    picks = {
        "chosen": plan.chosen,
        "fastest": min(fitting, key=_cost, default=None),
        "least_memory": min(every, key=lambda p: p.reserved_bytes),
        "numerics_preserving": min(same, key=_cost, default=None)
        or min([plan.baseline, *keep], key=lambda p: p.reserved_bytes),
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
    out.append(
        "a shorter sequence length shrinks activations at least in proportion "
        "(attention scores with its square)"
    )
    return out


def card_table(w: Workload, margin: float = SAFETY_MARGIN) -> list[dict[str, Any]]:
    """ "Which card do I need": for every listed card, fits as-is / fits with a plan / does not fit."""
    rows = []
    for card in CARDS:
        plan = make_plan(w, Target(card.usable_bytes, card, margin))
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
