"""Which modules to checkpoint so that a config fits: greedily by measured bytes freed per millisecond
of recomputation, never a module nested in another chosen one, then without any choice the budget does
not need (``choose_checkpoints``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memdoctor.plan.config import Config
from memdoctor.plan.memory import (
    activation_scale,
    apart_under_full_offload,
    checkpointed_gradients,
    offloaded_state,
    ranks,
    reserved_ratio,
)
from memdoctor.plan.model import Prediction
from memdoctor.plan.parallel import engine_floor, sharded
from memdoctor.plan.target import Target, fits, predict_for
from memdoctor.plan.workload import Candidate, Workload


def with_checkpoints(w: Workload, config: Config, target: Target, allowed: bool = True) -> Prediction | None:
    """``config`` as is when it fits (or checkpoints are not ``allowed``), else with the checkpoints that
    make it fit (None: none do)."""
    p = predict_for(w, config, target)
    if fits(p, target) or not allowed:
        return p
    chosen = choose_checkpoints(w, config, target)
    if not chosen:
        return p
    return predict_for(w, checkpointed(config, chosen), target)


def checkpointed(config: Config, chosen: list[Candidate]) -> Config:
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
    if best and not fits(predict_for(w, checkpointed(config, best), target), target):
        return []  # the linear estimate was off by rounding: say nothing fits rather than guess
    return best


def _needed_saving(w: Workload, config: Config, target: Target) -> float | None:
    """Net activation bytes (as measured, before micro-batch and autocast scaling) that checkpointing
    must free for ``config`` to fit; None when even no activations at all would not fit."""
    p0 = predict_for(w, config, target)
    parts = dict(p0.breakdown)
    # Count as ``predict`` does for the checkpointed config: its gradients (a share of them with
    # checkpointing alone; FSDP2's sharded ones as they are), its allocator slack, the optimizer step's
    # own peak.
    _, grads = offloaded_state(w, config, [])
    grads = checkpointed_gradients(grads, config)
    parts["gradients"] = -(-grads // ranks(config)) if sharded(config) and not config.full_offload else grads
    if config.full_offload:
        apart_under_full_offload(parts, [])
    rest = sum(parts.values()) - parts["activations"]
    floor = engine_floor(w, config, parts, [])
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
