"""Device facts: what card the run had, and how fast its host link really is.

At start, before the script runs, ``DeviceFactsCollector`` writes one run-wide ``collector`` record
``device``: torch's view of the card (name, memory, compute capability, bf16), NVML's (driver, the
driver's CUDA version, other processes' memory, the PCIe link), and a measured host<->device bandwidth,
pinned and pageable, each way. Every fact it cannot get is ``null`` in the record and named, with the
reason, in the record's ``not_measured``: a zero would read as a measurement.

When a trained model is discovered on a CUDA device and its state (parameters, gradients, optimizer
state) exceeds the budget, the record is written again with ``host_optimizer``: the host's measured
foreach AdamW rate (``memdoctor.capture.hostoptimizer``), which full offload's time depends on.

The bandwidth test copies a 64 MiB buffer (less on a nearly full card) a few times each way, timed with
CUDA events on the device: about a tenth of a second. It runs before the script allocates anything,
frees what it allocated and resets the peak statistics, so the script's memory figures do not see it.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from memdoctor.capture.collectors import Collector
from memdoctor.capture.hostoptimizer import measure_host_optimizer, state_estimate, worth_measuring
from memdoctor.device import Device, nvml

BANDWIDTH_BYTES = 64 * 2**20
BANDWIDTH_REPEATS = 3
NO_CUDA = "no CUDA device"


class DeviceFactsCollector(Collector):
    """Emits the ``device`` record at start; nothing per step."""

    name = "device"

    def __init__(self, device: Device | None = None, measure_bandwidth: bool = True, **_: Any) -> None:
        self.device = device
        self.measure = measure_bandwidth
        self.session: Any = None
        self.facts: dict[str, Any] | None = None

    def start(self, session: Any) -> None:
        self.session = session
        self.facts = gather(self.device or session.device, measure=self.measure)
        session.emit(self.name, self.facts)

    def on_model(self, model: int, root: Any) -> None:
        """Measure the host's optimizer rate once, where full offload is plausible (module docstring):
        at the models' discovery (the first optimizer step, or the fault of a run that died before it),
        when what the models hold on the device is known. Its fraction of a second counts in that step's
        optimizer phase (a warm-up step by default); the device's memory figures do not see it."""
        facts, session = self.facts, self.session
        if facts is None or session is None or facts.get("host_optimizer") is not None or not self.measure:
            return
        found = list(session.models)
        optimizers = [str(o.get("class")) for m in found for o in m.info.optimizers]
        state = state_estimate([m.modules[0] for m in found], optimizers, device_type="cuda")
        budget = _budget(self.device or session.device, facts)
        if worth_measuring(str(facts.get("kind")), state, budget):
            facts["host_optimizer"] = measure_host_optimizer()
            session.emit(self.name, facts)


def gather(device: Device, *, measure: bool = True) -> dict[str, Any]:
    """The ``device`` record for ``device``: facts, nulls for the unknown, and ``not_measured``."""
    facts = _empty(device.kind)
    missing: list[str] = []
    if device.kind != "cuda":
        facts["name"] = device.describe().get("name")
        why = NO_CUDA if device.kind == "cpu" else f"not a CUDA device ({device.kind})"
        nvml_why = nvml.unavailable_reason() or why
        missing += [f"{what}: {why}" for what in _TORCH_FACTS]
        missing += [f"{what}: {nvml_why}" for what in _NVML_FACTS]
        facts["not_measured"] = missing
        return facts
    index = int(getattr(device, "index", torch.cuda.current_device()))
    facts.update(_torch_facts(index))
    if measure:
        facts["bandwidth"], failed = measure_bandwidth(index)
        if failed:
            missing.append(f"host<->device bandwidth: {failed}")
    else:
        missing.append("host<->device bandwidth: not requested")
    _add_nvml_facts(facts, index, missing)  # after the copies: an idle link drops to a lower generation
    facts["not_measured"] = missing
    return facts


def _budget(device: Device, facts: dict[str, Any]) -> int | None:
    """The device memory the run may use: the cap (``--budget``), else the card's memory."""
    cap = device.describe().get("memory_cap_bytes")
    return int(cap) if cap else facts.get("total_memory_bytes")


_TORCH_FACTS = ("device memory", "compute capability", "bf16 support", "host<->device bandwidth")
_NVML_FACTS = ("NVIDIA driver version", "driver CUDA version", "other processes' memory", "PCIe link")
_NVML_KEYS = ("driver_version", "cuda_driver_version", "other_processes", "used_by_others_bytes", "pcie")


def _empty(kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "index": None,
        "name": None,
        "total_memory_bytes": None,
        "free_memory_bytes": None,
        "torch_version": torch.__version__,
        "cuda_runtime_version": torch.version.cuda,
        "cudnn_version": None,
        "capability": None,
        "multiprocessors": None,
        "bf16_supported": None,
        "bf16_native": None,
        **dict.fromkeys(_NVML_KEYS),
        "bandwidth": None,
        "host_optimizer": None,
        "not_measured": [],
    }


def _torch_facts(index: int) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    capability = [int(props.major), int(props.minor)]
    try:
        bf16: bool | None = bool(torch.cuda.is_bf16_supported())
    except Exception:
        bf16 = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "index": index,
        "name": props.name,
        "total_memory_bytes": int(total),
        "free_memory_bytes": int(free),
        "cudnn_version": cudnn,
        "capability": capability,
        "multiprocessors": int(props.multi_processor_count),
        # torch's answer counts emulation (bf16 runs on Turing, slowly); native bf16 needs Ampere (8.0).
        "bf16_supported": bf16,
        "bf16_native": capability >= [8, 0],
    }


def _add_nvml_facts(facts: dict[str, Any], index: int, missing: list[str]) -> None:
    dev, why = nvml.open_device(index)
    if dev is None:
        missing += [f"{what}: {why}" for what in _NVML_FACTS]
        return
    facts["driver_version"] = dev.driver_version()
    facts["cuda_driver_version"] = dev.cuda_driver_version()
    procs = dev.other_processes()
    facts["other_processes"] = procs
    if procs is not None and all(p["used_memory_bytes"] is not None for p in procs):
        facts["used_by_others_bytes"] = sum(p["used_memory_bytes"] for p in procs)
    else:
        missing.append("other processes' memory: NVML does not report it here")
    facts["pcie"] = dev.pcie_link()
    if facts["pcie"] is None:
        missing.append("PCIe link: NVML does not report it for this device")
    for key, what in (
        ("driver_version", "NVIDIA driver version"),
        ("cuda_driver_version", "driver CUDA version"),
    ):
        if facts[key] is None:
            missing.append(f"{what}: NVML did not answer")


def measure_bandwidth(index: int) -> tuple[dict[str, Any] | None, str | None]:
    """Host<->device copy bandwidth, pinned and pageable, each way: ``({..._bytes_per_s}, None)``, or
    ``(None, why)``. Timed with CUDA events (device time of the copy), median of a few repeats."""
    free, _ = torch.cuda.mem_get_info(index)
    nbytes = min(BANDWIDTH_BYTES, free // 4)
    if nbytes < 2**20:
        return None, "less than 4 MiB free on the device"
    out: dict[str, Any] = {"bytes": nbytes, "repeats": BANDWIDTH_REPEATS}
    try:
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        for pinned in (True, False):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            kind = "pinned" if pinned else "pageable"
            out[f"h2d_{kind}_bytes_per_s"] = _rate(gpu, host, nbytes, pinned)
            out[f"d2h_{kind}_bytes_per_s"] = _rate(host, gpu, nbytes, pinned)
            del host
        del gpu
    except torch.OutOfMemoryError:
        return None, f"could not allocate {nbytes // 2**20} MiB for the test"
    finally:
        _release(index)
    return out, None


def _rate(dst: torch.Tensor, src: torch.Tensor, nbytes: int, non_blocking: bool) -> int:
    """Bytes/s of ``dst.copy_(src)``: one untimed warm-up copy, then the median of the timed ones."""
    times = []
    for i in range(BANDWIDTH_REPEATS + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=non_blocking)
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return int(nbytes / (statistics.median(times) / 1000.0))


def _release(index: int) -> None:
    """Give the test's buffers back, so the script's memory figures start clean."""
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(index)
    # The pinned buffer stays in torch's pinned-host cache otherwise; emptying that cache is a private
    # API, used only where this torch has it (else 64 MiB of pinned host memory stay cached).
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()
