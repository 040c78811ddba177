"""Every touch of CUDA goes through here, so the rest of memdoctor runs and is tested on a CPU.

A ``Device`` gives the profiler three things: time markers (a wall clock on CPU, CUDA events on a GPU,
resolved to milliseconds once per step so no hook ever synchronises), the caching allocator's figures
(CUDA only), and facts about the card. ``FakeDevice`` stands in for a GPU in tests.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch


class Device:
    """The CPU: wall-clock markers, no allocator."""

    kind = "cpu"
    has_allocator = False

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "cpu",
            "name": platform.processor() or platform.machine() or "cpu",
            "total_memory_bytes": _host_memory_bytes(),
            "capability": None,
            "memory_cap_bytes": None,
        }

    def not_measured(self) -> list[str]:
        return [
            "CUDA allocator figures (allocated, reserved, fragmentation): no CUDA device; "
            "memory is tensor accounting",
            "GPU kernel times: no CUDA device; times are host wall clock",
        ]

    def marker(self) -> Any:
        return time.perf_counter()

    def resolve_ms(self, markers: list[Any]) -> list[float]:
        """Milliseconds of each marker since the first one."""
        if not markers:
            return []
        t0 = markers[0]
        return [(m - t0) * 1000.0 for m in markers]

    def ready(self, marker: Any) -> bool:
        """Whether a marker's time can be read without waiting."""
        return True

    def release_markers(self, markers: list[Any]) -> None:
        """Give markers back to the pool once resolved (CUDA events are reused)."""

    def memory(self) -> tuple[int, int, int] | None:
        """(allocated, reserved, max_allocated) from the caching allocator, or None."""
        return None

    def reset_peak(self) -> None:
        """Start a new peak measurement (once per step)."""

    def allocator_counters(self) -> dict[str, int] | None:
        return None

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def apply_cap(self, budget_bytes: int) -> int | None:
        """Cap this process's device memory to emulate a smaller card; returns the cap applied."""
        return None


_RAW_MEMORY_STATS = getattr(torch._C, "_cuda_memoryStats", None)
# Paths into the allocator's statistics: (allocated, reserved, peak allocated) and
# (peak reserved, allocation retries, OOMs).
_MEMORY_KEYS = (
    ("allocated_bytes", "all", "current"),
    ("reserved_bytes", "all", "current"),
    ("allocated_bytes", "all", "peak"),
)
_COUNTER_KEYS = (("reserved_bytes", "all", "peak"), ("num_alloc_retries",), ("num_ooms",))


class CudaDevice(Device):
    """A CUDA GPU: events for time, the caching allocator for memory."""

    kind = "cuda"
    has_allocator = True

    def __init__(self, index: int | None = None) -> None:
        self.index = torch.cuda.current_device() if index is None else index
        self._pool: list[Any] = []
        self._cap: int | None = None

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.index)
        return {
            "kind": "cuda",
            "name": props.name,
            "index": self.index,
            "total_memory_bytes": int(props.total_memory),
            "capability": [props.major, props.minor],
            "memory_cap_bytes": self._cap,
            "bf16_supported": bool(torch.cuda.is_bf16_supported()),
            "torch_cuda": torch.version.cuda,
        }

    def not_measured(self) -> list[str]:
        return []

    def marker(self) -> Any:
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve_ms(self, markers: list[Any]) -> list[float]:
        if not markers:
            return []
        markers[-1].synchronize()
        t0 = markers[0]
        return [0.0] + [t0.elapsed_time(m) for m in markers[1:]]

    def ready(self, marker: Any) -> bool:
        return bool(marker.query())

    def release_markers(self, markers: list[Any]) -> None:
        self._pool.extend(markers)

    def memory(self) -> tuple[int, int, int] | None:
        allocated, reserved, peak = self._allocator_stats(_MEMORY_KEYS)
        return allocated, reserved, peak

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def allocator_counters(self) -> dict[str, int] | None:
        max_reserved, retries, ooms = self._allocator_stats(_COUNTER_KEYS)
        return {"max_reserved": max_reserved, "num_alloc_retries": retries, "num_ooms": ooms}

    def _allocator_stats(self, keys: tuple[tuple[str, ...], ...]) -> list[int]:
        """The caching allocator's counters at ``keys`` (paths into its nested statistics).

        torch.cuda.memory_stats flattens the allocator's nested dict in Python (~167 us a read on the
        H200 host, most of a timing step's overhead; 23 us without the flattening); the nested dict it
        starts from is a private binding, so it is read behind a feature check, with the public call
        (the same paths joined by ".") as the fallback."""
        raw = _RAW_MEMORY_STATS
        if raw is not None:
            try:
                nested = raw(self.index)
                out = []
                for path in keys:
                    value = nested
                    for part in path:
                        value = value[part]
                    out.append(int(value))
                return out
            except (KeyError, TypeError, RuntimeError):
                pass
        flat = torch.cuda.memory_stats(self.index)
        return [int(flat.get(".".join(path), 0)) for path in keys]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def apply_cap(self, budget_bytes: int) -> int | None:
        total = torch.cuda.get_device_properties(self.index).total_memory
        if budget_bytes >= total:
            return None
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, self.index)
        self._cap = budget_bytes
        return budget_bytes


class FakeDevice(Device):
    """A GPU stand-in for tests: a settable allocator and a manual clock."""

    kind = "fake"
    has_allocator = True

    def __init__(self, total: int = 8 * 2**30) -> None:
        self.total = total
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.now_ms = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "fake",
            "name": "FakeDevice",
            "total_memory_bytes": self.total,
            "capability": None,
            "memory_cap_bytes": None,
        }

    def not_measured(self) -> list[str]:
        return ["everything: this is a fake device for tests"]

    def marker(self) -> Any:
        return self.now_ms / 1000.0

    def memory(self) -> tuple[int, int, int] | None:
        self.peak = max(self.peak, self.allocated)
        return self.allocated, self.reserved, self.peak

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def allocator_counters(self) -> dict[str, int] | None:
        return {"max_reserved": self.reserved, "num_alloc_retries": 0, "num_ooms": 0}


def default_device() -> Device:
    """The device a training script on this machine will use: CUDA when present, else the CPU."""
    if torch.cuda.is_available():
        return CudaDevice()
    return Device()


def _host_memory_bytes() -> int | None:
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
