"""What one step's transfers add up to (``StepLog``), and the PCIe counter sampler (``PcieSampler``).

The wrappers of ``transferwraps`` hand each copy to ``TransferCollector.transfer``, which adds it to
its step's ``StepLog``; the log turns into the step record's ``collectors.transfers`` field. Kept apart
from the collector so the record's shape can be read in one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from memdoctor.device import Device

COPY_CAP = 256  # copies listed one by one per step; the rest are aggregated
PCIE_SAMPLES_CAP = 200  # PCIe samples per step in the trace
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
READ_OPS = frozenset(n.strip("_") for n in READS)  # the ``op`` a read is logged as

Reader = Callable[[], "tuple[int, int] | None"]
Raw = tuple[str, str, int, bool, bool, bool, str, Any, str, float, Any]


class StepLog:
    """What one step moved: the first ``COPY_CAP`` copies one by one, the rest aggregated."""

    __slots__ = ("copies", "groups", "more_count", "pinned_bytes", "pinned_calls", "timed")

    def __init__(self) -> None:
        self.copies: list[Raw] = []
        self.groups: dict[tuple[Any, ...], list[float]] = {}
        self.more_count = 0
        self.timed = 0
        self.pinned_bytes = 0
        self.pinned_calls = 0

    def add(self, raw: Raw) -> None:
        if len(self.copies) < COPY_CAP:
            self.copies.append(raw)
            return
        op, direction, nbytes, pinned, nb, sync, phase, where, _site, host_ms, _ = raw
        key = (direction, phase, where, pinned, nb, op)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = [0, 0, 0.0]
        group[0] += 1
        group[1] += nbytes
        group[2] += host_ms if sync else 0.0
        self.more_count += 1

    def to_field(self, device: Device) -> dict[str, Any]:
        copies = [_copy_row(raw, device) for raw in list(self.copies)]
        groups = [_group_row(k, v) for k, v in list(self.groups.items())]
        return {
            "h2d": _totals("h2d", copies, groups),
            "d2h": _totals("d2h", copies, groups),
            "sync_reads": sum(1 for c in copies if c["op"] in READ_OPS)
            + sum(g["count"] for g in groups if g["op"] in READ_OPS),
            "pinned_host": {"bytes": self.pinned_bytes, "calls": self.pinned_calls},
            "copies": copies,
            "more": {"count": self.more_count, "groups": groups},
        }


def _copy_row(raw: Raw, device: Device) -> dict[str, Any]:
    op, direction, nbytes, pinned, nb, sync, phase, where, site, host_ms, marks = raw
    device_ms = None
    if marks is not None:
        ms = device.resolve_ms(marks)
        device_ms = round(max(0.0, ms[1] - ms[0]), 4)
    return {
        "op": op,
        "dir": direction,
        "bytes": nbytes,
        "pinned": pinned,
        "non_blocking": nb,
        "sync": sync,
        "phase": phase,
        "model": where[0] if where else None,
        "module": where[1] if where else None,
        "site": site,
        "host_ms": round(host_ms, 4) if sync else None,
        "device_ms": device_ms,
    }


def _group_row(key: tuple[Any, ...], value: list[float]) -> dict[str, Any]:
    direction, phase, where, pinned, nb, op = key
    return {
        "op": op,
        "dir": direction,
        "phase": phase,
        "model": where[0] if where else None,
        "module": where[1] if where else None,
        "pinned": pinned,
        "non_blocking": nb,
        "count": int(value[0]),
        "bytes": int(value[1]),
        "host_ms": round(value[2], 4),
    }


def _totals(direction: str, copies: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [c for c in copies if c["dir"] == direction]
    more = [g for g in groups if g["dir"] == direction]
    timed = [c["device_ms"] for c in mine if c["device_ms"] is not None]
    return {
        "bytes": sum(c["bytes"] for c in mine) + sum(g["bytes"] for g in more),
        "copies": len(mine) + sum(g["count"] for g in more),
        "pageable_bytes": sum(c["bytes"] for c in mine if not c["pinned"])
        + sum(g["bytes"] for g in more if not g["pinned"]),
        "sync": sum(1 for c in mine if c["sync"]) + sum(g["count"] for g in more if not g["non_blocking"]),
        "host_ms": round(sum(c["host_ms"] or 0.0 for c in mine) + sum(g["host_ms"] for g in more), 4),
        "device_ms": round(sum(timed), 4) if timed else None,
        "untimed": sum(1 for c in mine if not c["sync"] and c["device_ms"] is None)
        + sum(g["count"] for g in more if g["non_blocking"]),
    }


def pcie_field(samples: list[tuple[float, int, int]]) -> dict[str, Any] | None:
    """The step's PCIe samples ``[t_ms, tx, rx]`` (bytes/s; t since profiling start) and their means."""
    if not samples:
        return None
    kept = samples[:PCIE_SAMPLES_CAP]
    n = len(samples)
    return {
        "samples": [[round(t, 1), tx, rx] for t, tx, rx in kept],
        "count": n,
        "tx_mean_bytes_per_s": int(sum(s[1] for s in samples) / n),
        "rx_mean_bytes_per_s": int(sum(s[2] for s in samples) / n),
        "tx_max_bytes_per_s": max(s[1] for s in samples),
        "rx_max_bytes_per_s": max(s[2] for s in samples),
    }


# ---------------------------------------------------------------------------------------- sampler


class PcieSampler(threading.Thread):
    """Reads the PCIe throughput counters every ``interval`` seconds until ``halt()``."""

    MAX_SAMPLES = 100_000
    MAX_FAILURES = 3

    def __init__(self, reader: Reader, interval: float, step: Callable[[], int]) -> None:
        # Not a daemon, so the test suite sees a sampler left running; it also ends by itself once the
        # main thread has (interpreter shutdown), so a missed stop() cannot hang the script's exit.
        super().__init__(name="memdoctor-pcie", daemon=False)
        self.reader, self.interval, self.step = reader, interval, step
        self.samples: list[tuple[float, int, int, int]] = []  # (perf_counter, step, tx, rx)
        self.stopped = threading.Event()

    def run(self) -> None:
        main, failures = threading.main_thread(), 0
        while not self.stopped.wait(self.interval) and main.is_alive():
            try:
                value = self.reader()
            except Exception:  # the sampler must never raise
                value = None
            if value is None:
                failures += 1
                if failures >= self.MAX_FAILURES:
                    return
                continue
            if len(self.samples) < self.MAX_SAMPLES:
                self.samples.append((time.perf_counter(), self.step(), int(value[0]), int(value[1])))

    def halt(self) -> None:
        self.stopped.set()

    def for_step(self, step: int, t0: float) -> list[tuple[float, int, int]]:
        return [((t - t0) * 1000.0, tx, rx) for t, s, tx, rx in list(self.samples) if s == step]
