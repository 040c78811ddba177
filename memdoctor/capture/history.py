"""An exact ledger at the peak, from the CUDA caching allocator's own record of one step.

The hook-based ledger sees the tensors that matter for a plan (parameters, gradients, optimizer state,
activations saved for backward) but not the short-lived buffers an op allocates while it runs (the two
logits-sized gradients of a language model's loss, AdamW's ``foreach`` scratch lists). For the first
and the last profiled step memdoctor asks the allocator to record every allocation with its Python
stack (``torch.cuda.memory._record_memory_history``), replays that record to the step's peak, and
attributes every block live at that moment: by address to a known tensor (a parameter, a gradient, an
optimizer state tensor, a saved activation) or, failing that, to the code that allocated it.

This uses PyTorch's private ``_record_memory_history`` / ``_snapshot`` (present since 2.1), so it sits
behind a feature check; without it the report falls back to the tensor accounting, whose remainder
against ``max_memory_allocated`` is labelled "other".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

MAX_ENTRIES = 500_000
TOP_SITES = 12


def available() -> bool:
    mem = getattr(torch.cuda, "memory", None)
    return bool(
        torch.cuda.is_available()
        and hasattr(mem, "_record_memory_history")
        and hasattr(mem, "_snapshot")
        and os.environ.get("MEMDOCTOR_NO_HISTORY") != "1"
    )


class HistoryRecorder:
    """Start and stop the allocator's history for one step; ``stop`` returns the step's entries."""

    def __init__(self) -> None:
        self.active = False

    def start(self) -> None:
        try:
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
            )
            self.active = True
        except (RuntimeError, TypeError, AttributeError):
            self.active = False

    def stop(self) -> list[dict[str, Any]] | None:
        if not self.active:
            return None
        self.active = False
        try:
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap.get("device_traces") or []
        index = torch.cuda.current_device()
        return list(traces[index]) if index < len(traces) else None


def _replay(entries: list[dict[str, Any]]) -> tuple[int, int]:
    """(index of the entry at which allocation peaked, bytes allocated above the start there)."""
    running, best, best_i = 0, 0, -1
    for i, e in enumerate(entries):
        action = e.get("action")
        if action == "alloc":
            running += int(e.get("size", 0))
            if running > best:
                best, best_i = running, i
        elif action == "free_completed":
            running -= int(e.get("size", 0))
    return best_i, best


def _live_at(entries: list[dict[str, Any]], upto: int) -> dict[int, dict[str, Any]]:
    live: dict[int, dict[str, Any]] = {}
    for e in entries[: upto + 1]:
        action = e.get("action")
        if action == "alloc":
            live[int(e["addr"])] = e
        elif action == "free_completed":
            live.pop(int(e.get("addr", -1)), None)
    return live


def _freed_from_baseline(entries: list[dict[str, Any]], upto: int) -> int:
    """Bytes freed up to entry ``upto`` of blocks allocated before the record started."""
    born: set[int] = set()
    freed = 0
    for e in entries[: upto + 1]:
        action, addr = e.get("action"), int(e.get("addr", -1))
        if action == "alloc":
            born.add(addr)
        elif action == "free_completed":
            if addr in born:
                born.discard(addr)
            else:
                freed += int(e.get("size", 0))
    return freed


def _match(ptrs: dict[int, int], entry: dict[str, Any]) -> int | None:
    nbytes = ptrs.get(int(entry.get("addr", -1)))
    if nbytes is None:
        return None
    size = int(entry.get("size", 0))
    return nbytes if size == max(512, -(-nbytes // 512) * 512) or size == nbytes else None


def _site(frames: Iterable[dict[str, Any]] | None) -> str:
    """The allocating code: the innermost frame, and the first frame outside PyTorch that led there."""
    # memdoctor's own frames (a collector's dispatch mode or copy wrapper on the stack) are not the
    # allocating code: skip them, so the site names the script's line.
    # The dispatch plumbing a dispatch mode adds (OpOverload.__call__ inside __torch_dispatch__) is not
    # the allocating code either.
    frames = [f for f in frames or [] if not _file(f).startswith(_SKIPPED) and _MEMDOCTOR_DIR not in _file(f)]
    if not frames:
        return "autograd backward (no Python frame)"
    inner = _fmt(frames[0])
    # Outside PyTorch: not under torch's package directory. (A "/torch/" substring test would also
    # skip every package of a virtual environment that happens to live under a folder named torch.)
    outer = next((f for f in frames if not _file(f).startswith(_TORCH_DIR)), None)
    if outer is None or outer is frames[0]:
        return inner
    return f"{inner} <- {_fmt(outer)}"


_MEMDOCTOR_DIR = os.sep + "memdoctor" + os.sep + "capture" + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIPPED = (_TORCH_DIR + "_ops.py", os.path.join(_TORCH_DIR, "utils", "_python_dispatch.py"))


def _file(frame: dict[str, Any]) -> str:
    return str(frame.get("filename", ""))


def _fmt(frame: dict[str, Any]) -> str:
    return f"{os.path.basename(str(frame.get('filename', '?')))}:{frame.get('line')} ({frame.get('name')})"


def ledger_at_peak(
    entries: list[dict[str, Any]] | None,
    *,
    baseline: int,
    baseline_known: dict[str, int],
    known: dict[str, dict[int, int]],
) -> dict[str, Any] | None:
    """Attribute every byte allocated at the step's peak.

    ``baseline`` is what was allocated when the record started (tensors that outlive steps);
    ``baseline_known`` says how much of it the tensor accounting explains, per category; ``known`` maps
    a category to the storage addresses of its tensors, for the blocks allocated during the step.
    """
    if not entries:
        return None
    peak_i, above = _replay(entries)
    if peak_i < 0:
        return None
    cats = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "activations": 0, "temporaries": 0}
    # Parameters moved to the GPU after recording began are in the record, not in the baseline.
    moved = sum(
        int(e.get("size", 0))
        for e in entries[: peak_i + 1]
        if e.get("action") == "alloc" and _match(known.get("parameters", {}), e) is not None
    )
    baseline_known = dict(baseline_known)
    baseline_known["parameters"] = max(0, baseline_known.get("parameters", 0) - moved)
    for k, v in baseline_known.items():
        cats[k] = cats.get(k, 0) + v
    sites: dict[str, int] = {}
    for _addr, e in _live_at(entries, peak_i).items():
        size = int(e.get("size", 0))
        cat = next((c for c, ptrs in known.items() if _match(ptrs, e) is not None), None)
        if cat is None:
            cats["temporaries"] += size
            site = _site(e.get("frames"))
            sites[site] = sites.get(site, 0) + size
        else:
            cats[cat] += size
    # Blocks that were live when the record started and were freed before the peak (the previous
    # step's gradients, freed by zero_grad) are in the baseline but not at the peak.
    freed_early = _freed_from_baseline(entries, peak_i)
    unattributed = max(0, baseline - freed_early - sum(baseline_known.values()))
    top = sorted(sites.items(), key=lambda kv: -kv[1])[:TOP_SITES]
    peak_entry = entries[peak_i]
    return {
        "source": "allocator_history",
        "peak_allocated": baseline + above,
        "baseline": baseline,
        "categories": {**cats, "unattributed": unattributed},
        "temporaries_by_site": [[s, n] for s, n in top],
        "peak_site": _site(peak_entry.get("frames")),
        "entries": len(entries),
    }
