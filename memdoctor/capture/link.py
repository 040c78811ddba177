"""The link between the ranks, measured once: a few MB all-reduced a few times, the median taken.

The planner prices what a sharding strategy moves with this figure (the ``link`` collector record,
docs/trace-format.md). It runs outside the timed steps, at the point every rank reaches together: the
end of the last requested step. A collective that one rank never joins hangs the others, and one joined
late pairs with the wrong call, so the ranks first agree through the process group's store: each checks
in, and the first rank to see all of them in writes ``go``, the first whose wait runs out ``skip``
(``compare_set``: one decision, which all of them read). A rank that died or lags is skipped, never
waited for past ``wait_s``. The store is private API (``_get_default_store``), read behind a check: without
it the link is not measured, and the record says so.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch

from memdoctor.device import Device

LINK_BYTES = 4 * 2**20
REPEATS = 5  # timed all-reduces, after one untimed
WAIT_S = 20.0  # the longest a rank waits for the others to reach the measurement
POLL_S = 0.01
_rounds = itertools.count()  # the same on every rank of an SPMD job: the store keys of each measurement


def measure_link(device: Device, wait_s: float | None = None) -> dict[str, Any] | None:
    """The ``link`` record's data, or None without a process group of two or more ranks; the ranks
    wait ``wait_s`` (default ``WAIT_S``) for each other at most."""
    wait_s = WAIT_S if wait_s is None else wait_s
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world, backend = dist.get_world_size(), str(dist.get_backend())
    facts: dict[str, Any] = {"backend": backend, "world_size": world, "op": "all_reduce"}
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        store = get_store() if get_store is not None else None
    except Exception:
        store = None
    if store is None:
        return {**facts, "measured": False, "reason": "no process-group store to agree on a moment"}
    if not agree(store, f"memdoctor/link/{next(_rounds)}", world, wait_s):
        why = f"not every rank reached the measurement within {wait_s:g} s"
        return {**facts, "measured": False, "reason": why}
    seconds = _time_all_reduce(dist, device, backend)
    median = statistics.median(seconds)
    algo = LINK_BYTES / median
    return {
        **facts,
        "measured": True,
        "bytes": LINK_BYTES,
        "repeats": len(seconds),
        "median_s": round(median, 6),
        "algo_bytes_per_s": round(algo),
        "bytes_per_s": round(algo * 2 * (world - 1) / world),  # bus bandwidth, as nccl-tests reports it
    }


def agree(store: Any, key: str, world: int, wait_s: float) -> bool:
    """Whether every rank reached ``key`` within ``wait_s``: one decision all ranks read."""
    ready, decision = f"{key}/ready", f"{key}/decision"
    store.add(ready, 1)
    deadline = time.monotonic() + wait_s
    while True:
        if store.check([decision]):
            return bool(store.get(decision) == b"go")
        if store.add(ready, 0) >= world:
            return bool(store.compare_set(decision, "", "go") == b"go")
        if time.monotonic() > deadline:
            return bool(store.compare_set(decision, "", "skip") == b"go")
        time.sleep(POLL_S)


def _time_all_reduce(dist: Any, device: Device, backend: str) -> list[float]:
    on_gpu = device.kind == "cuda" and "nccl" in backend
    where = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    buf = torch.ones(LINK_BYTES // 4, dtype=torch.float32, device=where)
    seconds = []
    for i in range(REPEATS + 1):
        device.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        device.synchronize()
        if i:
            seconds.append(time.perf_counter() - t0)
    return seconds
