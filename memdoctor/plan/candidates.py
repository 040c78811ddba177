"""The modules a plan could change: checkpoint candidates (what each frees, what recomputing it costs)
and parameter-offload holders, from the peak step's layer table.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace
from typing import Any

from memdoctor.analysis.layers import children, repeated_blocks, subtree_sums
from memdoctor.plan.workload import Candidate, ParamHolder
from memdoctor.trace import Trace

MIN_CANDIDATE_BYTES = 1024**2  # modules freeing less are not worth a checkpoint wrapper


# Parameter offload: modules holding at least this share of the parameter bytes are candidates, least
# forward time per parameter byte first (embeddings, then LM heads); at most this many are tried.
OFFLOAD_MIN_SHARE = 0.05
OFFLOAD_MAX_MODULES = 2


def candidates(trace: Trace, rows: list[dict[str, Any]], notes: list[str] | None = None) -> list[Candidate]:
    """Modules below the root with a measured ``checkpoint_free_bytes`` and forward time (a block's
    first-call outlier capped: ``steady_forward_ms``)."""
    out = []
    for r in rows:
        free, ms = r["checkpoint_free_bytes"], r["forward_ms"]
        if r["depth"] >= 1 and free is not None and free >= MIN_CANDIDATE_BYTES and ms is not None:
            out.append(_candidate(trace, r, int(free), ms))
    return steady_forward_ms(out, notes if notes is not None else [])


def _candidate(trace: Trace, row: dict[str, Any], free: int, ms: float) -> Candidate:
    parents = next(m.parents for m in trace.models if m.index == row["model"])
    chain, p = [], parents[row["index"]]
    while p >= 0:
        chain.append((row["model"], p))
        p = parents[p]
    return Candidate(row["name"], row["model"], row["index"], row["depth"], free, float(ms), frozenset(chain))


def extrapolate_blocks(
    trace: Trace, rows: list[dict[str, Any]], notes: list[str]
) -> tuple[int, list[Candidate]]:
    """For a step cut short (an OOM): the blocks of a repeated stack that never ran are assumed to save
    what the median block that ran saved, and to take its forward time. Returns the added activation
    bytes and the added checkpoint candidates."""
    by_key = {(r["model"], r["index"]): r for r in rows}
    added, extra = 0, []
    for info in trace.models:
        if (info.index, 0) not in by_key:
            continue  # a model the plan does not change (memdoctor.plan.measure.planned_model)
        for blocks in repeated_blocks(info):
            ran = [by_key[(info.index, i)] for i in blocks if by_key[(info.index, i)]["calls"]]
            rest = [by_key[(info.index, i)] for i in blocks if not by_key[(info.index, i)]["calls"]]
            if not ran or not rest:
                continue
            act = int(statistics.median(r["activation_bytes"] or 0 for r in ran))
            free = int(statistics.median(r["checkpoint_free_bytes"] or 0 for r in ran))
            ms = [r["forward_ms"] for r in ran if r["forward_ms"] is not None]
            added += act * len(rest)
            if ms and free >= MIN_CANDIDATE_BYTES:
                extra += [_candidate(trace, r, free, statistics.median(ms)) for r in rest]
            notes.append(
                f"the run died before {len(rest)} of the {len(blocks)} {info.types[blocks[0]]} blocks ran: "
                f"each is assumed to save what the median block that ran saved ({act} bytes); modules "
                "after them are not counted (a lower bound)"
            )
    if not added:
        notes.append(
            "the peak step did not complete (the run died in it): modules that had not run yet are not in "
            "the ledger, so every prediction is a lower bound"
        )
    return added, extra


def param_holders(rows: list[dict[str, Any]]) -> list[ParamHolder]:
    """Modules holding at least ``OFFLOAD_MIN_SHARE`` of the parameter bytes, least forward time per
    parameter byte first: embeddings (a lookup) before LM heads (a matmul)."""
    total = sum(r["param_bytes"] or 0 for r in rows)
    big = [r for r in rows if total and (r["param_bytes"] or 0) >= OFFLOAD_MIN_SHARE * total]
    big.sort(key=lambda r: ((r["forward_ms"] or 0.0) / r["param_bytes"], r["index"]))
    return [
        ParamHolder(
            r["name"], int(r["param_bytes"]), int(r["grad_bytes"] or r["param_bytes"]), r["forward_ms"]
        )
        for r in big[:OFFLOAD_MAX_MODULES]
    ]


# A module of a repeated stack whose forward took more than this many times the median of the same
# module in the other blocks is taken at that median: the first block's first call carries one-off
# costs (library handles, kernel autotuning). In GPT-2's re-profile under the HF Trainer, whose peak
# step was its warm-up, block 0 took 188 ms against 19 ms for each of the others, and costed
# checkpointing every block at twice its recomputation.
STACK_OUTLIER_FACTOR = 2.0
STACK_MIN_BLOCKS = 3
_STACK_INDEX = re.compile(r"\.\d+(?=\.|$)")


def steady_forward_ms(cands: list[Candidate], notes: list[str]) -> list[Candidate]:
    """``cands`` with each stack outlier's forward time set to its siblings' median (constants above)."""
    groups: dict[tuple[int, int, str], list[float]] = {}
    for c in cands:
        groups.setdefault(_sibling_key(c), []).append(c.forward_ms)
    out, capped = [], []
    for c in cands:
        times = groups[_sibling_key(c)]
        median = statistics.median(times) if len(times) >= STACK_MIN_BLOCKS else None
        if median is not None and c.forward_ms > STACK_OUTLIER_FACTOR * median:
            capped.append(f"{c.name} {c.forward_ms:.1f} ms")
            c = replace(c, forward_ms=median)
        out.append(c)
    if capped:
        notes.append(
            f"forward time taken at the median of the same module in the other blocks for {len(capped)} "
            f"module{'s' if len(capped) > 1 else ''} measured at over {STACK_OUTLIER_FACTOR:g}x it "
            f"({', '.join(capped[:3])}{', ...' if len(capped) > 3 else ''}: first-call costs)"
        )
    return out


def _sibling_key(c: Candidate) -> tuple[int, int, str]:
    return (c.model, c.depth, _STACK_INDEX.sub(".#", c.name))


# FSDP2 (fully_shard with CPUOffloadPolicy), which full offload applies, came with torch 2.4.
FSDP2_TORCH = (2, 4)


def shard_units(trace: Trace, notes: list[str] | None = None) -> tuple[int, ...]:
    """Parameter bytes of each unit full offload (``memdoctor.levers.offload_full``) and FSDP2 shard
    before the root (``shard_blocks``)."""
    return shard_blocks(trace, notes)[1]


def shard_blocks(trace: Trace, notes: list[str] | None = None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The names and parameter bytes of each unit full offload (``memdoctor.levers.offload_full``) and
    FSDP2 (``shard_modules``) shard before the root, in the largest model: the members of its repeated
    stacks of blocks (modules with children), else its top-level children holding parameters; the rest of
    the parameters stay with the root's unit. Empty (full offload and FSDP2 not planned, said in
    ``notes``) when the profiled torch has no FSDP2."""
    version = str((trace.header.get("host") or {}).get("torch") or "")
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) < FSDP2_TORCH:
        if notes is not None:
            notes.append(f"full offload not planned: torch {version} has no FSDP2 (torch >= 2.4)")
        return (), ()
    if not trace.models:
        return (), ()
    info = max(trace.models, key=lambda m: sum(m.param_bytes))
    sums = subtree_sums(info, info.param_bytes)
    kids = children(info)
    units = [i for group in repeated_blocks(info) if kids[group[0]] for i in group]  # blocks, not leaves
    if not units:
        units = [k for k in kids[0] if sums[k] > 0]
    return tuple(info.names[i] for i in units), tuple(sums[i] for i in units)
