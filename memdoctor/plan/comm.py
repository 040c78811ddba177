"""Communication between the ranks of a several-GPU plan: the bytes each engine moves over a rank's link
in one step (``moved_bytes``) and the rate it moves them at (``collective_rate``: measured, the card's
published figure, or a stated assumption; ``measured_link`` reads the trace's measured one).
``memdoctor.plan.timing`` turns the two into milliseconds.

Ring collectives, the algorithm NCCL and gloo use for large tensors: over N ranks an all-reduce of S
bytes sends 2(N-1)/N x S over each rank's link, an all-gather or a reduce-scatter of S (the unsharded
size) (N-1)/N x S.
"""

from __future__ import annotations

from typing import Any

from memdoctor.cards import Card, device_card, find_card
from memdoctor.errors import UsageError
from memdoctor.plan.config import Config
from memdoctor.plan.memory import ranks
from memdoctor.plan.workload import Workload
from memdoctor.trace import Trace

# CPU runs: gloo over the loopback of one host. Measured once on the 2-core development machine (2
# processes, a 64 MB all-reduce: 0.62 GB/s of bus bandwidth; 0.29 GB/s at 4 MB): an assumption for any
# other host, stated as one wherever it is used. A trace's measured ``device.link`` replaces it.
GLOO_CPU_BYTES_PER_S = 0.6e9


def moved_bytes(w: Workload, config: Config) -> dict[str, float]:
    """Bytes each rank sends over its link in one optimizer step, by collective; empty for one process.

    DDP: an all-reduce of every gradient per micro-batch (DDP reduces in every backward unless the
    script uses ``no_sync``: an upper bound with micro-batches). FSDP2: per micro-batch, an all-gather
    of every parameter in forward, of the shard units' again in backward when it reshards after forward
    (the root's stay gathered), and a reduce-scatter of every gradient. FSDP2 with CPU offload moves the
    same; its host copies are ``memdoctor.plan.timing``'s full-offload transfers."""
    n = ranks(config)
    if n == 1:
        return {}
    k = config.accumulation_steps
    share = (n - 1) / n
    if config.parallel == "ddp":
        return {"all_reduce": 2 * share * w.gradients * k}
    again = sum(b for n, b in zip(w.shard_names, w.shard_units, strict=False) if n in config.shard_modules)
    again = again if config.parallel == "fsdp2" else 0
    return {
        "all_gather": share * (w.parameters + again) * k,
        "reduce_scatter": share * w.gradients * k,
    }


def measured_link(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """The ``Workload`` fields of a measured collective rate: the ``link`` of the device record
    (``{backend, bytes_per_s, measured: true, world_size}``), read as it is found (``summary.json``'s
    device, the device collector's record, the header's device); none when not measured."""
    places = [summary.get("device"), trace.collected.get("device"), trace.device]
    links = [p["link"] for p in places if isinstance(p, dict) and isinstance(p.get("link"), dict)]
    link: dict[str, Any] = links[0] if links else {}
    rate = link.get("bytes_per_s")
    if not link.get("measured") or not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate <= 0:
        return {}
    size = link.get("world_size")
    return {
        "link_bytes_per_s": float(rate),
        "link_backend": str(link.get("backend")) if link.get("backend") else None,
        "link_world_size": int(size) if isinstance(size, int) and not isinstance(size, bool) else None,
    }


def collective_rate(w: Workload, card_name: str | None) -> tuple[float, str] | None:
    """Bytes a second a collective moves over one rank's link, and what the figure rests on: the
    trace's measured link (its ``device.link``) for the card it was measured on; a named card's
    published NVLink or PCIe figure (``Card.gpu_link``), else the profiled GPU's; on a CPU run gloo's
    (``GLOO_CPU_BYTES_PER_S``, an assumption); for a GPU not in the table, the measured host link (PCIe)
    as a stand-in. None when nothing is known."""
    card = _card(card_name)
    profiled = device_card(w.device_name) if w.device_kind == "cuda" else None
    if w.link_bytes_per_s and (card is None or card == profiled):
        size = f" over {w.link_world_size} ranks" if w.link_world_size else ""
        backend = w.link_backend or "the job's backend"
        return w.link_bytes_per_s, (
            f"measured: {backend} collective bandwidth{size} ({w.link_bytes_per_s / 1e9:.2f} GB/s)"
        )
    if card is not None:
        return card.gpu_link()
    if w.device_kind == "cpu":
        return GLOO_CPU_BYTES_PER_S, (
            f"assumption: gloo on one host at {GLOO_CPU_BYTES_PER_S / 1e9:.1f} GB/s (measured once on a "
            "2-core machine; the trace measured no link)"
        )
    if profiled is not None:
        return profiled.gpu_link()
    if w.offload_bytes_per_s:
        return w.offload_bytes_per_s, (
            f"assumption: the measured pinned host<->device rate ({w.offload_bytes_per_s / 1e9:.1f} GB/s) "
            "between the cards (PCIe; the GPU is not in the card table)"
        )
    return None


def _card(name: str | None) -> Card | None:
    if not name:
        return None
    try:
        return find_card(name)
    except UsageError:
        return None
