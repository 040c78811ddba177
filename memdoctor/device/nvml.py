"""Every NVML call goes through here (the device facts, the PCIe throughput sampler).

NVML (``pynvml``, from the ``nvidia-ml-py`` package: ``pip install memdoctor[gpu]``) knows what torch
does not: the driver version, other processes on the card, the PCIe link and its live throughput.
It is optional: ``open_device`` returns ``(None, why)`` when the package or the driver is missing, and
callers write ``why`` into the trace's ``not_measured`` instead of guessing a value.

NVML numbers its GPUs in PCI order regardless of ``CUDA_VISIBLE_DEVICES``, so torch's device index is
mapped to NVML's handle through the PCI bus id (then the UUID, then the index as a last resort).
"""

from __future__ import annotations

import os
from typing import Any

NO_PACKAGE = "pynvml not installed (pip install memdoctor[gpu])"
NO_DRIVER = "no NVIDIA driver"

# Usable bytes/s per lane and direction of a PCIe link, by generation (after line encoding:
# 8b/10b for Gen1-2, 128b/130b for Gen3-5, FLIT for Gen6).
PCIE_LANE_BYTES_PER_S = {
    1: 250_000_000,
    2: 500_000_000,
    3: 984_615_384,
    4: 1_969_230_769,
    5: 3_938_461_538,
    6: 7_563_000_000,
}


class NvmlDevice:
    """One GPU as NVML sees it; every getter returns None where NVML cannot answer."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    def _get(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except Exception:  # NVMLError_NotSupported on some boards, AttributeError on old bindings
            return None

    def name(self) -> str | None:
        name = self._get("nvmlDeviceGetName", self.handle)
        return name.decode() if isinstance(name, bytes) else name

    def memory(self) -> tuple[int, int] | None:
        """(total, free) bytes of the whole card."""
        info = self._get("nvmlDeviceGetMemoryInfo", self.handle)
        return (int(info.total), int(info.free)) if info is not None else None

    def driver_version(self) -> str | None:
        v = self._get("nvmlSystemGetDriverVersion")
        return v.decode() if isinstance(v, bytes) else v

    def cuda_driver_version(self) -> str | None:
        """The highest CUDA version the driver supports, e.g. ``"12.4"``."""
        v = self._get("nvmlSystemGetCudaDriverVersion_v2")
        if v is None:
            v = self._get("nvmlSystemGetCudaDriverVersion")
        return f"{v // 1000}.{(v % 1000) // 10}" if isinstance(v, int) and v > 0 else None

    def other_processes(self) -> list[dict[str, Any]] | None:
        """Other processes holding memory on this card: ``[{pid, used_memory_bytes}]`` (bytes null where
        the driver does not tell, e.g. inside a container without the host's PID namespace)."""
        procs: dict[int, int | None] = {}
        answered = False
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            found = self._get(fn, self.handle)
            if found is None:
                continue
            answered = True
            for p in found:
                used = getattr(p, "usedGpuMemory", None)
                procs[int(p.pid)] = int(used) if isinstance(used, int) else procs.get(int(p.pid))
        if not answered:
            return None
        me = os.getpid()
        return [{"pid": pid, "used_memory_bytes": used} for pid, used in sorted(procs.items()) if pid != me]

    def pcie_link(self) -> dict[str, Any] | None:
        """Current and maximum PCIe generation and width, and the maximum link's bytes/s each way."""
        gen = self._get("nvmlDeviceGetCurrPcieLinkGeneration", self.handle)
        width = self._get("nvmlDeviceGetCurrPcieLinkWidth", self.handle)
        gen_max = self._get("nvmlDeviceGetMaxPcieLinkGeneration", self.handle)
        width_max = self._get("nvmlDeviceGetMaxPcieLinkWidth", self.handle)
        if gen is None and gen_max is None:
            return None
        return {
            "gen": gen,
            "width": width,
            "gen_max": gen_max,
            "width_max": width_max,
            "link_bytes_per_s": link_bytes_per_s(gen_max, width_max),
            "link_bytes_per_s_current": link_bytes_per_s(gen, width),
        }

    def pcie_throughput(self) -> tuple[int, int] | None:
        """(TX, RX) bytes/s over NVML's last ~20 ms window: TX leaves the GPU (device to host), RX
        reaches it (host to device). Each call blocks for that window, so only a sampler thread calls it."""
        tx = self._get("nvmlDeviceGetPcieThroughput", self.handle, self.nvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._get("nvmlDeviceGetPcieThroughput", self.handle, self.nvml.NVML_PCIE_UTIL_RX_BYTES)
        if tx is None or rx is None:
            return None
        return int(tx) * 1024, int(rx) * 1024  # NVML reports KB/s


def link_bytes_per_s(gen: Any, width: Any) -> int | None:
    """A PCIe link's usable bytes/s per direction, or None for an unknown generation or width."""
    if not isinstance(gen, int) or not isinstance(width, int) or gen not in PCIE_LANE_BYTES_PER_S:
        return None
    return PCIE_LANE_BYTES_PER_S[gen] * width if width > 0 else None


def open_device(torch_index: int) -> tuple[NvmlDevice | None, str | None]:
    """The NVML view of torch's CUDA device ``torch_index``, or ``(None, why not)``."""
    why = unavailable_reason()  # nvmlInit is reference-counted: repeated calls are cheap and harmless
    if why is not None:
        return None, why
    import pynvml

    handle = _handle(pynvml, torch_index)
    if handle is None:
        return None, f"NVML does not list CUDA device {torch_index}"
    return NvmlDevice(pynvml, handle), None


def unavailable_reason() -> str | None:
    """Why NVML cannot be used on this machine, or None when it can."""
    try:
        import pynvml
    except ImportError:
        return NO_PACKAGE
    try:
        pynvml.nvmlInit()
    except Exception:
        return NO_DRIVER
    return None


def _handle(pynvml: Any, torch_index: int) -> Any:
    for lookup, key in _keys(torch_index):
        try:
            return getattr(pynvml, lookup)(key)
        except Exception:
            continue
    return None


def _keys(torch_index: int) -> list[tuple[str, Any]]:
    """NVML lookups for torch's device, most reliable first."""
    keys: list[tuple[str, Any]] = []
    try:
        import torch

        props = torch.cuda.get_device_properties(torch_index)
        bus = getattr(props, "pci_bus_id", None)
        if isinstance(bus, int):
            domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            keys.append(("nvmlDeviceGetHandleByPciBusId", f"{domain:08x}:{bus:02x}:{dev:02x}.0"))
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            text = str(uuid)
            keys.append(("nvmlDeviceGetHandleByUUID", text if text.startswith("GPU-") else f"GPU-{text}"))
    except Exception:  # no CUDA in torch: only the index is left
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible.strip():
        keys.append(("nvmlDeviceGetHandleByIndex", torch_index))
    return keys
