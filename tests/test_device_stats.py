"""CudaDevice's allocator reads: the nested statistics binding and the public fallback agree (no CUDA
needed: both are stood in for)."""

from __future__ import annotations

import pytest
import torch

import memdoctor.device.devices as dev_mod

NESTED = {
    "allocated_bytes": {"all": {"current": 5, "peak": 9}},
    "reserved_bytes": {"all": {"current": 7, "peak": 11}},
    "num_alloc_retries": 2,
    "num_ooms": 1,
}
FLAT = {
    "allocated_bytes.all.current": 5,
    "allocated_bytes.all.peak": 9,
    "reserved_bytes.all.current": 7,
    "reserved_bytes.all.peak": 11,
    "num_alloc_retries": 2,
    "num_ooms": 1,
}


@pytest.mark.parametrize("nested", [NESTED, {}, None], ids=["nested", "unexpected-shape", "no-binding"])
def test_memory_and_counters_from_either_source(monkeypatch: pytest.MonkeyPatch, nested: dict | None) -> None:
    device = dev_mod.CudaDevice.__new__(dev_mod.CudaDevice)
    device.index = 0
    monkeypatch.setattr(dev_mod, "_RAW_MEMORY_STATS", None if nested is None else (lambda i: nested))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda i: FLAT)
    assert device.memory() == (5, 7, 9)
    assert device.allocator_counters() == {"max_reserved": 11, "num_alloc_retries": 2, "num_ooms": 1}
