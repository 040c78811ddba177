"""The run's memory timeline as a PyTorch memory snapshot, the pickle ``torch.cuda.memory._snapshot()``
returns, which https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` draw.

A memdoctor trace holds no single allocations: it holds each category's total (parameters,
gradients, optimizer state, activations) at every module boundary, and the CUDA allocator's figure
where it was read. So the snapshot is made of *synthetic* blocks, built the way torch's own
``_profile_to_snapshot`` builds one from a profiler run: when a category's total grows between two
samples, one block of the growth is allocated (``category`` set, so the viewer colours by it; its
frame names the module, phase and step); when it shrinks, that category's newest blocks are freed
until the total fits (the last one re-allocated smaller where the cut falls inside it). Replayed,
the blocks of each category add up to the trace's total at every sample. ``other`` is the allocator's
figure less the accounted categories, where the allocator was read (CUDA traces).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from memdoctor.analysis.runtimeline import run_timeline
from memdoctor.trace import CATEGORIES, Trace

ACCOUNTING = tuple(c for c in CATEGORIES if c != "other")
_ALIGN = 512  # the CUDA caching allocator's rounding: addresses look like the allocator's own
_BASE = 0x7F0000000000


@dataclass
class _Block:
    addr: int
    size: int
    frames: list[dict[str, Any]]


def _rounded(size: int) -> int:
    return max(_ALIGN, -(-size // _ALIGN) * _ALIGN)


@dataclass
class _Replay:
    """The synthetic allocator: first fit in a free list (so freed addresses are reused and the one
    segment stays the size of the peak, as a caching allocator's would), each category's live blocks
    (newest last), and the events."""

    next_addr: int = _BASE
    free: list[tuple[int, int]] = field(default_factory=list)  # (address, size), sorted, coalesced
    live: dict[str, list[_Block]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def total(self, category: str) -> int:
        return sum(b.size for b in self.live.get(category, []))

    def alloc(self, category: str, size: int, frames: list[dict[str, Any]], time_us: int) -> None:
        block = _Block(self._place(_rounded(size)), size, frames)
        self.live.setdefault(category, []).append(block)
        self.events.append(_event("alloc", block, time_us, category))

    def _place(self, size: int) -> int:
        for k, (addr, room) in enumerate(self.free):
            if room >= size:
                self.free[k : k + 1] = [(addr + size, room - size)] if room > size else []
                return addr
        addr, self.next_addr = self.next_addr, self.next_addr + size
        return addr

    def _release(self, block: _Block) -> None:
        self.free.append((block.addr, _rounded(block.size)))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for addr, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((addr, size))
        self.free = merged

    def free_down_to(self, category: str, target: int, time_us: int) -> None:
        """Free the category's newest blocks until it holds at most ``target``; a block cut through is
        freed whole and its remaining part allocated again (a snapshot's blocks never shrink)."""
        blocks = self.live.get(category, [])
        while blocks and self.total(category) > target:
            block = blocks.pop()
            self._release(block)
            for action in ("free_requested", "free_completed"):
                self.events.append(_event(action, block, time_us, category))
            keep = target - self.total(category)
            if keep > 0:
                self.alloc(category, keep, block.frames, time_us)

    def set_total(self, category: str, target: int, frames: list[dict[str, Any]], time_us: int) -> None:
        have = self.total(category)
        if target > have:
            self.alloc(category, target - have, frames, time_us)
        elif target < have:
            self.free_down_to(category, target, time_us)


def _event(action: str, block: _Block, time_us: int, category: str) -> dict[str, Any]:
    return {
        "action": action,
        "addr": block.addr,
        "size": block.size,
        "stream": 0,
        "time_us": time_us,
        "frames": block.frames,
        "category": category,
    }


def memory_snapshot(trace: Trace) -> dict[str, Any]:
    """The snapshot (``segments``, ``device_traces``, ``allocator_settings``) of ``trace``'s timeline."""
    cols = run_timeline(trace)
    replay = _Replay()
    t0 = int(float(trace.header.get("created_unix") or 0) * 1e6)
    for i in range(len(cols["time_ms"])):
        time_us = t0 + int(cols["time_ms"][i] * 1000)
        frames = [_frame(cols, i)]
        targets = _targets(cols, i)
        # Shrinks before growths: between two samples the replay never holds more than either does.
        for category, target in sorted(targets.items(), key=lambda ct: ct[1] >= replay.total(ct[0])):
            replay.set_total(category, target, frames, time_us)
    device = int(trace.device.get("index") or 0)
    return {
        "segments": [_segment(replay, device)] if replay.next_addr > _BASE else [],
        "device_traces": [[] for _ in range(device)] + [replay.events],
        "allocator_settings": {"memdoctor_synthetic": True},
    }


def memory_snapshot_pickle(trace: Trace) -> bytes:
    """``memory_snapshot`` pickled as ``torch.cuda.memory._dump_snapshot`` writes it (plain types only)."""
    return pickle.dumps(memory_snapshot(trace))


def _targets(cols: dict[str, list[Any]], i: int) -> dict[str, int]:
    """Each category's total at sample ``i``: the accounted ones where measured, and ``other`` where the
    allocator was read (its figure less what the accounting explains, never below zero)."""
    out = {c: int(cols[c][i]) for c in ACCOUNTING if cols[c][i] is not None}
    if cols["allocated"][i] is not None and len(out) == len(ACCOUNTING):
        out["other"] = max(0, int(cols["allocated"][i]) - sum(out.values()))
    return out


def _frame(cols: dict[str, list[Any]], i: int) -> dict[str, Any]:
    """Where a block's bytes appeared: the module (or the step's phase) and the sample's event, as a
    stack frame the viewer shows (``filename:line:name``; the line is the step)."""
    where = cols["name"][i] or f"({cols['phase'][i] or 'step'})"
    return {
        "filename": str(where),
        "line": int(cols["step"][i]),
        "name": f"step {cols['step'][i]} {cols['event'][i]}",
    }


def _segment(replay: _Replay, device: int) -> dict[str, Any]:
    """One segment spanning every address handed out, with the blocks still live at the end (the state
    the viewer replays the trace back from) and the gaps between them inactive."""
    live = sorted((b for blocks in replay.live.values() for b in blocks), key=lambda b: b.addr)
    blocks: list[dict[str, Any]] = []
    at = _BASE
    for b in live:
        if b.addr > at:
            blocks.append({"address": at, "size": b.addr - at, "requested_size": 0, "state": "inactive"})
        size = _rounded(b.size)
        blocks.append(
            {
                "address": b.addr,
                "size": size,
                "requested_size": b.size,
                "state": "active_allocated",
                "frames": b.frames,
            }
        )
        at = b.addr + size
    if replay.next_addr > at:
        blocks.append(
            {"address": at, "size": replay.next_addr - at, "requested_size": 0, "state": "inactive"}
        )
    total = replay.next_addr - _BASE
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": device,
        "address": _BASE,
        "total_size": total,
        "allocated_size": active,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in blocks),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "blocks": blocks,
    }
