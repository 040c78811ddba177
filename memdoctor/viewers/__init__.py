"""The run's memory timeline in the formats of viewers people already use: a Chrome/Perfetto trace
(``perfetto``) and a PyTorch memory snapshot for memory_viz (``memoryviz``). Reads the trace through
analysis only; writes nothing itself (``memdoctor timeline`` writes the file).
"""

from __future__ import annotations

from collections.abc import Callable

from memdoctor.trace import Trace
from memdoctor.viewers.memoryviz import memory_snapshot, memory_snapshot_pickle
from memdoctor.viewers.perfetto import perfetto_json, perfetto_trace

# Each format: its file's contents, and the suffix its file usually has.
FORMATS: dict[str, tuple[Callable[[Trace], str | bytes], str]] = {
    "perfetto": (perfetto_json, ".json"),
    "memory-viz": (memory_snapshot_pickle, ".pickle"),
}

__all__ = ["FORMATS", "memory_snapshot", "memory_snapshot_pickle", "perfetto_json", "perfetto_trace"]
