"""Common GPUs for ``--gpu NAME``: memory, bf16 support, PCIe generation and compute capability.

Figures are the vendors' datasheet values (nominal memory, not measured). Data-center cards with ECC on
(T4, V100, A10, A100, H100) report somewhat less memory to CUDA than the nominal size; the context
reserve below and the planner's safety margin are meant to cover that, and a measured figure (the
``device`` record of a trace profiled on the card) is always better.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memdoctor.errors import UsageError

GiB = 1024**3
MiB = 1024**2
# An assumption, not a measurement: what the CUDA context (cuBLAS/cuDNN handles, kernels) and the
# caching allocator's own reserve take from a card before the first tensor. ~300-500 MiB is typical for
# a PyTorch process on recent drivers; we take the upper end so that a plan errs on the side of fitting.
CONTEXT_RESERVE_BYTES = 512 * MiB
# Per direction, x16 link, theoretical; transfers reach ~80% of it (``PCIE_EFFICIENCY``, an assumption).
PCIE_BYTES_PER_S = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9}
PCIE_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Card:
    """One GPU model as its datasheet describes it."""

    key: str  # what --gpu accepts (case and punctuation ignored)
    name: str
    memory_bytes: int
    bf16: bool  # native bf16 (compute capability 8.0 or newer)
    pcie_gen: int
    capability: tuple[int, int]

    @property
    def usable_bytes(self) -> int:
        """Memory a training process can fill: the card less ``CONTEXT_RESERVE_BYTES`` (an assumption)."""
        return self.memory_bytes - CONTEXT_RESERVE_BYTES

    @property
    def pcie_bytes_per_s(self) -> float:
        """Expected host<->device rate: the link's datasheet rate times ``PCIE_EFFICIENCY`` (assumed)."""
        return PCIE_BYTES_PER_S[self.pcie_gen] * PCIE_EFFICIENCY

    @property
    def fp16_tensor_cores(self) -> bool:
        return self.capability >= (7, 0)


CARDS: tuple[Card, ...] = (
    Card("rtx2070", "GeForce RTX 2070", 8 * GiB, False, 3, (7, 5)),
    Card("rtx2080ti", "GeForce RTX 2080 Ti", 11 * GiB, False, 3, (7, 5)),
    Card("rtx3060", "GeForce RTX 3060", 12 * GiB, True, 4, (8, 6)),
    Card("rtx3090", "GeForce RTX 3090", 24 * GiB, True, 4, (8, 6)),
    Card("rtx4090", "GeForce RTX 4090", 24 * GiB, True, 4, (8, 9)),
    Card("t4", "Tesla T4", 16 * GiB, False, 3, (7, 5)),
    Card("v100-16gb", "Tesla V100 16GB", 16 * GiB, False, 3, (7, 0)),
    Card("v100-32gb", "Tesla V100 32GB", 32 * GiB, False, 3, (7, 0)),
    Card("a10", "A10", 24 * GiB, True, 4, (8, 6)),
    Card("l4", "L4", 24 * GiB, True, 4, (8, 9)),
    Card("a100-40gb", "A100 40GB", 40 * GiB, True, 4, (8, 0)),
    Card("a100-80gb", "A100 80GB", 80 * GiB, True, 4, (8, 0)),
    Card("h100-80gb", "H100 80GB", 80 * GiB, True, 5, (9, 0)),
    Card("h200", "H200", 141 * 10**9, True, 5, (9, 0)),
)
_ALIASES = {"v100": "v100-16gb", "a100": "a100-40gb", "h100": "h100-80gb"}


def _norm(text: str) -> str:
    return re.sub(
        r"[^a-z0-9]", "", text.lower().replace("geforce", "").replace("tesla", "").replace("nvidia", "")
    )


def find_card(name: str) -> Card:
    """The card ``name`` designates (``rtx2070``, ``RTX 2070``, ``A100-80GB``, ``t4``); a ``UsageError``
    listing the known names otherwise."""
    want = _norm(name)
    want = _norm(_ALIASES.get(want, want))
    for card in CARDS:
        if want in (_norm(card.key), _norm(card.name)):
            return card
    known = ", ".join(c.key for c in CARDS)
    raise UsageError(f"unknown GPU {name!r}: --gpu takes one of {known} (or give --budget SIZE)")
