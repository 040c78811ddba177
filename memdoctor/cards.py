"""The one GPU table: every card memdoctor knows, one row each with all its datasheet facts.

Two readers: ``--gpu NAME`` and the planner's card table (memory, bf16, PCIe generation, compute
capability: the rows with a ``key``), and the roofline of the compute section and the planner's autocast
time (peak FLOP/s and memory bandwidth, matched on the device name torch reports: the rows with a
``match``). Some cards only the roofline knows: ``--gpu`` does not offer them.

Figures are the vendors' datasheet values (nominal memory, not measured; NVLink and PCIe rates as
published, for the planner's several-GPU time: ``Card.gpu_link``). Data-center cards with ECC on
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
# Collectives between the cards of one host (the planner's several-GPU time, ``gpu_link``): a ring
# all-reduce, all-gather or reduce-scatter moves its bytes over each card's link in one direction at a
# time, at this share of the published rate (nccl-tests' bus bandwidth on NVLink and PCIe machines is
# typically 75-85% of it; an assumption, as ``PCIE_EFFICIENCY``).
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Peaks:
    """Dense datasheet peaks, no sparsity: FP32 without TF32 (PyTorch's default for float32 matmuls),
    the 16-bit tensor-core rate (GeForce cards: with FP32 accumulation, what PyTorch uses; bf16 runs
    at the fp16 rate on a card with native bf16) and the memory bandwidth."""

    float32: float  # FLOP/s
    float16: float  # FLOP/s
    bandwidth: float  # bytes/s


@dataclass(frozen=True)
class Card:
    """One GPU model as its datasheet describes it."""

    key: str | None  # what --gpu accepts (case and punctuation ignored); None: --gpu does not offer it
    name: str
    memory_bytes: int
    pcie_gen: int
    capability: tuple[int, int]
    match: str | None = None  # found in torch's device name: this card's peaks; None: no peaks known
    peaks: Peaks | None = None
    # NVLink between the cards of one board, per direction: the published total (both directions) / 2.
    # Only for parts whose NVLink is always there (SXM boards); a PCIe card's optional bridge is not
    # assumed (None: the cards talk over PCIe).
    nvlink_bytes_per_s: float | None = None

    @property
    def usable_bytes(self) -> int:
        """Memory a training process can fill: the card less ``CONTEXT_RESERVE_BYTES`` (an assumption)."""
        return self.memory_bytes - CONTEXT_RESERVE_BYTES

    @property
    def pcie_bytes_per_s(self) -> float:
        """Expected host<->device rate: the link's datasheet rate times ``PCIE_EFFICIENCY`` (assumed)."""
        return PCIE_BYTES_PER_S[self.pcie_gen] * PCIE_EFFICIENCY

    def gpu_link(self) -> tuple[float, str]:
        """The rate collectives between two such cards run at (bytes a second, one direction) and what
        it rests on: NVLink where the board has it, else PCIe; both the published figure times
        ``LINK_EFFICIENCY`` (an assumption)."""
        if self.nvlink_bytes_per_s:
            rate = self.nvlink_bytes_per_s * LINK_EFFICIENCY
            what = f"{self.name} NVLink, published {2 * self.nvlink_bytes_per_s / 1e9:.0f} GB/s both ways"
        else:
            rate = PCIE_BYTES_PER_S[self.pcie_gen] * LINK_EFFICIENCY
            published = PCIE_BYTES_PER_S[self.pcie_gen]
            what = f"{self.name} PCIe Gen{self.pcie_gen} x16, published {published / 1e9:.1f} GB/s"
        return rate, f"assumption: the card's published link figure ({what}) x {LINK_EFFICIENCY:.0%}"

    @property
    def bf16(self) -> bool:
        """Native bf16: compute capability 8.0 (Ampere) or newer."""
        return self.capability >= (8, 0)

    @property
    def fp16_tensor_cores(self) -> bool:
        return self.capability >= (7, 0)


V100 = Peaks(15.7e12, 125e12, 0.9e12)  # one chip, two memory sizes

# fmt: off
GPU_TABLE: tuple[Card, ...] = (
    # --gpu key, name, memory, PCIe generation, compute capability;
    #     the name's part in torch's device name, Peaks(FP32, 16-bit FLOP/s, memory bytes/s)
    Card("rtx2070", "GeForce RTX 2070", 8 * GiB, 3, (7, 5),
         "RTX 2070", Peaks(7.5e12, 29.9e12, 0.448e12)),
    Card("rtx2080ti", "GeForce RTX 2080 Ti", 11 * GiB, 3, (7, 5)),
    Card("rtx3060", "GeForce RTX 3060", 12 * GiB, 4, (8, 6)),
    Card("rtx3090", "GeForce RTX 3090", 24 * GiB, 4, (8, 6),
         "RTX 3090", Peaks(35.6e12, 71e12, 0.936e12)),
    Card("rtx4090", "GeForce RTX 4090", 24 * GiB, 4, (8, 9),
         "RTX 4090", Peaks(82.6e12, 165.2e12, 1.008e12)),
    Card("t4", "Tesla T4", 16 * GiB, 3, (7, 5),
         "T4", Peaks(8.1e12, 65e12, 0.32e12)),
    Card("v100-16gb", "Tesla V100 16GB", 16 * GiB, 3, (7, 0),
         "V100", V100),
    Card("v100-32gb", "Tesla V100 32GB", 32 * GiB, 3, (7, 0),
         "V100", V100),
    Card("a10", "A10", 24 * GiB, 4, (8, 6)),
    Card("l4", "L4", 24 * GiB, 4, (8, 9),
         "L4", Peaks(30.3e12, 121e12, 0.3e12)),
    Card(None, "L40S", 48 * GiB, 4, (8, 9),
         "L40S", Peaks(91.6e12, 362e12, 0.864e12)),
    Card("a100-40gb", "A100 40GB", 40 * GiB, 4, (8, 0),
         "A100", Peaks(19.5e12, 312e12, 1.555e12)),
    Card("a100-80gb", "A100 80GB", 80 * GiB, 4, (8, 0),
         "A100-SXM4-80GB", Peaks(19.5e12, 312e12, 2.039e12), nvlink_bytes_per_s=300e9),
    Card(None, "A100 80GB PCIe", 80 * GiB, 4, (8, 0),
         "A100 80GB PCIe", Peaks(19.5e12, 312e12, 1.935e12)),
    Card("h100-80gb", "H100 80GB", 80 * GiB, 5, (9, 0),
         "H100", Peaks(67e12, 989e12, 3.35e12), nvlink_bytes_per_s=450e9),
    Card(None, "H100 PCIe", 80 * GiB, 5, (9, 0),
         "H100 PCIe", Peaks(51e12, 756e12, 2.0e12)),
    Card(None, "H100 NVL", 94 * GiB, 5, (9, 0),
         "H100 NVL", Peaks(60e12, 835e12, 3.9e12)),
    Card("h200", "H200", 141 * 10**9, 5, (9, 0),
         "H200", Peaks(67e12, 989e12, 4.8e12), nvlink_bytes_per_s=450e9),
    Card(None, "H200 NVL", 141 * 10**9, 5, (9, 0),
         "H200 NVL", Peaks(60e12, 835e12, 4.8e12)),
)
# fmt: on
# The cards --gpu names and the planner's card table lists, in table order.
CARDS: tuple[Card, ...] = tuple(card for card in GPU_TABLE if card.key)
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
        if want in (_norm(card.key or ""), _norm(card.name)):
            return card
    known = ", ".join(c.key or "" for c in CARDS)
    raise UsageError(f"unknown GPU {name!r}: --gpu takes one of {known} (or give --budget SIZE)")


def device_card(name: str | None) -> Card | None:
    """The row of the GPU table a device name (as torch reports it) designates, or None for an unknown
    device. A pattern matches as a case-insensitive substring; the longest one found wins, so
    ``H100 NVL`` is not read as ``H100``, nor ``L40S`` as ``L4``."""
    low = (name or "").lower()
    found = [c for c in GPU_TABLE if c.match and c.peaks and c.match.lower() in low]
    return max(found, key=lambda c: len(c.match or "")) if found else None


def device_peaks(name: str | None) -> tuple[str, dict[str, float]] | None:
    """``(matched pattern, peaks by dtype and "bandwidth")`` for a device name (``device_card``), or
    None for an unknown device."""
    card = device_card(name)
    if card is None:
        return None
    peaks = card.peaks
    assert card.match is not None and peaks is not None
    out = {"float32": peaks.float32, "float16": peaks.float16, "bandwidth": peaks.bandwidth}
    if card.bf16:
        out["bfloat16"] = peaks.float16
    return card.match, out
