"""What a plan must fit (``Target``: a budget, a safety margin, a card's traits) and how the planner
compares the configs that fit it (``cost``): predicted extra time, then simplicity, then the nine-grid
cell's lever order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memdoctor.cards import Card
from memdoctor.plan.config import Config
from memdoctor.plan.model import Prediction, predict
from memdoctor.plan.ninegrid import lever_priority
from memdoctor.plan.workload import Workload

SAFETY_MARGIN = 0.10  # a plan must leave this share of the budget free


# The lever order where no nine-grid cell is known (the usual hand-tuning order: checkpointing or
# offload, then dynamic batching, then mixed precision); ``make_plan`` takes the cell's order.
DEFAULT_PRIORITY = tuple(lever_priority(None))


@dataclass
class Target:
    """What the plan must fit: a byte budget, and the card's traits when one is named."""

    budget_bytes: int  # per card
    card: Card | None = None
    margin: float = SAFETY_MARGIN
    gpus: int = 1  # cards (one process each): above 1, every config searched spreads over them

    @property
    def limit_bytes(self) -> int:
        return int(self.budget_bytes * (1.0 - self.margin))

    def bf16(self, w: Workload) -> bool | None:
        return self.card.bf16 if self.card else w.bf16_native

    def fp16_first(self, w: Workload) -> bool:
        """Whether fp16 autocast (with its GradScaler) belongs in the planner's first tier, as bf16 does
        on a card that has it: for a named card (``--gpu``) without native bf16 whose tensor cores run
        fp16 (Volta, Turing: the RTX 20xx, the T4), where the precision verdict says the measured ranges
        keep fp16 safe and the script has an optimizer to drive the GradScaler from. There fp16 is the
        card's one fast 16-bit path, the lever a hand tuner of such a card reaches for first. Without a
        named card fp16 stays in the second tier: this trace does not say what the profiled GPU's
        tensor cores run (``--gpu NAME`` says it)."""
        card = self.card
        if card is None or card.bf16 or not card.fp16_tensor_cores:
            return False
        return fp16_allowed(w)

    def offloads(self, w: Workload) -> bool:
        """Whether moving state to host memory frees any of the budget (the offload levers: parameters,
        optimizer state, full offload): on a CUDA device, the card named (``--gpu``) or the profiled one;
        not for a CPU run planned for itself, whose host and device memory are the same memory."""
        return self.card is not None or w.device_kind in (None, "cuda")

    def link(self, w: Workload) -> float | None:
        return self.card.pcie_bytes_per_s if self.card else w.offload_bytes_per_s

    def card_name(self) -> str | None:
        return self.card.name if self.card else None


def fp16_allowed(w: Workload) -> bool:
    """fp16 autocast is planned only where the precision verdict measured it safe (activations inside
    fp16's range, gradients fitting one loss scale), under no autocast of the script's own, and with an
    optimizer whose step drives the GradScaler."""
    return w.precision_verdict == "fp16_safe" and w.script_autocast is None and w.has_optimizer


def fits(p: Prediction, target: Target) -> bool:
    return p.reserved_bytes <= target.limit_bytes


def predict_for(w: Workload, config: Config, target: Target) -> Prediction:
    return predict(
        w, config, bf16=target.bf16(w), offload_bytes_per_s=target.link(w), card_name=target.card_name()
    )


def cost(p: Prediction, order: Sequence[str] = DEFAULT_PRIORITY) -> tuple[float, int, tuple[int, ...]]:
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
        f"{', '.join(config.levers())} would fit, but memdoctor run cannot apply optimizer: "
        f"{config.optimizer} (the script builds its own optimizer): build it as bitsandbytes' AdamW8bit"
    )
