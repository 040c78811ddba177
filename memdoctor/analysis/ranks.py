"""Figures across the ranks of one multi-process run (``memdoctor profile --nproc-per-node N``).

Each rank is a complete one-process run with its own trace and ``summary.json``; what no single rank
can say is how they compare: did every rank fit, which one is the worst, is the load balanced, how much
of a step goes to communication, and which rank failed first. Every figure here is measured (a rank's
peak, its median step time, the time its collectives took); nothing is predicted. The report module
reads the files and renders; this module only turns what they hold into the merged ``summary.json``.

Inputs are untrusted (``ranks.json`` and the traces come from disk): a malformed value is dropped, not
trusted, and a bad ``ranks.json`` is a ``ValueError`` the caller words for the user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from memdoctor.analysis.numbers import median
from memdoctor.trace import StepRecord, Trace
from memdoctor.units import format_bytes
from memdoctor.version import __version__

# How a rank ended, in the launcher's words (ranks.json); "unknown" where nothing says.
STATUSES = ("ok", "oom", "exception", "timeout", "interrupted", "killed")
UNKNOWN = "unknown"
FAILED = frozenset(STATUSES) - {"ok"}
# A trace's end status (docs/faults.md) in the launcher's words, for a folder without ranks.json.
_FROM_TRACE = {
    "completed": "ok",
    "script_finished": "ok",
    "no_steps": "ok",
    "oom": "oom",
    "exception": "exception",
    "config_error": "exception",
    "output_failed": "exception",
    "timeout": "timeout",
    "interrupted": "interrupted",
    "killed": "killed",
    "crashed": "killed",
}
# max/min at or under this is balanced: 10% is within a CPU's run-to-run noise on a small step.
BALANCED = 1.10
COLLECTIVES = "collectives"
MAX_OPS = 20  # collective operations listed per rank (a trace is untrusted: bounded)


@dataclass
class RankInput:
    """What the report layer read for one rank: its summary (read or built), its trace's figures, its
    ``ranks.json`` entry, and what could not be read (``problems``, one line each)."""

    rank: int
    folder: str  # "rank-K", relative to the run's folder
    summary: dict[str, Any] | None = None
    launch: dict[str, Any] | None = None  # its ranks.json entry
    end: dict[str, Any] | None = None  # its trace's end record
    ended_unix: float | None = None  # when its trace says it ended (for failed-first without ranks.json)
    collectives: dict[str, Any] | None = None  # collectives_per_step of its trace
    collectives_note: str = "not measured: its trace could not be read"
    report: str | None = None  # its report.html, relative to the merged report
    problems: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------- the inputs


def distributed_of(header: dict[str, Any]) -> dict[str, Any] | None:
    """The trace header's ``distributed`` field (docs/trace-format.md), when it is well formed."""
    value = header.get("distributed")
    if not isinstance(value, dict):
        return None
    rank, world = value.get("rank"), value.get("world_size")
    if not (_whole(rank) and _whole(world) and 0 <= rank < world):
        return None
    return value


def launch_record(data: Any) -> dict[str, Any]:
    """``ranks.json`` checked: ``world_size``, ``ranks`` by rank, ``failed_first`` (absent: the key is
    missing, so it is found from the ranks' end times) and ``failed_first_why``. ValueError says what
    is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    world = data.get("world_size")
    if not (_whole(world) and world >= 1):
        raise ValueError("its world_size is not a whole number of ranks")
    entries = data.get("ranks")
    if not isinstance(entries, list):
        raise ValueError("its ranks is not a list")
    ranks: dict[int, dict[str, Any]] = {}
    for entry in entries:
        rank = entry.get("rank") if isinstance(entry, dict) else None
        if not (_whole(rank) and 0 <= rank < world):
            raise ValueError(f"a rank entry's rank is not in 0..{world - 1}")
        if rank in ranks:
            raise ValueError(f"rank {rank} is listed twice")
        ranks[rank] = entry
    out: dict[str, Any] = {"world_size": world, "ranks": ranks, "failed_first_why": None}
    if "failed_first" in data:
        first = data["failed_first"]
        out["failed_first"] = first if _whole(first) and 0 <= first < world else None
        why = data.get("failed_first_why")
        out["failed_first_why"] = why if isinstance(why, str) and why else None
    return out


def status_from_end(end: dict[str, Any] | None) -> str:
    """A trace's end record (or a summary's ``status``) in the launcher's words."""
    status = (end or {}).get("status")
    if status == "script_exit":  # sys.exit(0) is a normal end, sys.exit(3) a failure
        return "ok" if (end or {}).get("exit_code") in (0, None) else "exception"
    return _FROM_TRACE.get(status, UNKNOWN) if isinstance(status, str) else UNKNOWN


def ended_unix(trace: Trace) -> float | None:
    """When the run ended: its start (the header's ``created_unix``) plus its duration (the end's)."""
    start, took = trace.header.get("created_unix"), (trace.end or {}).get("duration_s")
    return float(start) + float(took) if _number(start) and _number(took) else None


# --------------------------------------------------------------------------------------- collectives


def step_collectives(step: StepRecord) -> dict[str, Any] | None:
    """The step's ``collectives`` record ({ms, calls, bytes, by_op}) when it is well formed: on the
    step itself, or among its collectors' data."""
    value = getattr(step, COLLECTIVES, None)
    if not isinstance(value, dict):
        value = step.collectors.get(COLLECTIVES)
    if not isinstance(value, dict) or not _number(value.get("ms")) or value["ms"] < 0:
        return None
    return value


def collectives_per_step(trace: Trace) -> dict[str, Any] | None:
    """Time, calls and bytes of the rank's torch.distributed collectives per step (medians over the
    profiled steps that measured them; any step that did, when no profiled one did), the share of the
    step they took, and the same per operation. None when no step measured them."""
    steps = [(s, c) for s in trace.profiled_steps() if (c := step_collectives(s)) is not None]
    if not steps:
        steps = [(s, c) for s in trace.steps if (c := step_collectives(s)) is not None]
    if not steps:
        return None
    records = [c for _, c in steps]
    shares = [c["ms"] / s.duration_ms for s, c in steps if s.duration_ms]
    return {
        "source": "measured",
        "steps": len(steps),
        "ms_per_step": median([c["ms"] for c in records]),
        "calls_per_step": median([_count(c.get("calls")) for c in records]),
        "bytes_per_step": _int(median([_count(c.get("bytes")) for c in records])),
        "share_of_step": median(shares),
        "by_op": _by_op(records),
    }


def _by_op(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per operation, the median over the steps (a step that did not call it counts 0), most time first."""
    tables = [c["by_op"] if isinstance(c.get("by_op"), dict) else {} for c in records]
    rows = {}
    for op in {str(op) for table in tables for op in table}:
        each: list[dict[str, Any]] = [e if isinstance(e := t.get(op), dict) else {} for t in tables]
        rows[op] = {
            "ms": median([_count(e.get("ms")) for e in each]),
            "calls": median([_count(e.get("calls")) for e in each]),
            "bytes": _int(median([_count(e.get("bytes")) for e in each])),
        }
    ordered = sorted(rows.items(), key=lambda kv: (-(kv[1]["ms"] or 0), kv[0]))
    return dict(ordered[:MAX_OPS])


# ------------------------------------------------------------------------------------ the merged view


def rank_row(inp: RankInput) -> dict[str, Any]:
    """One rank's row of the merged ``summary.json``."""
    summary, launch = inp.summary or {}, inp.launch or {}
    status = launch.get("status") if isinstance(launch.get("status"), str) else None
    status = status or status_from_end(inp.end or summary)
    message = _text(launch.get("message")) or _text((inp.end or {}).get("message"))
    peak, budget = _opt_int(summary.get("peak_memory_bytes")), _opt_int(summary.get("budget_bytes"))
    return {
        "rank": inp.rank,
        "folder": inp.folder,
        "status": status,
        "exit_code": launch.get("exit_code", (inp.end or {}).get("exit_code")),
        "signal": launch.get("signal", (inp.end or {}).get("signal")),
        "message": message or _text(summary.get("status_message")),
        "peak_memory_bytes": peak,
        "step_time_ms": _opt_float(summary.get("step_time_ms")),
        "steps_profiled": _opt_int(summary.get("steps_profiled")),
        "budget_bytes": budget,
        "fits": _fits(status, peak, budget, bool(inp.summary)),
        "report": inp.report,
        "collectives": inp.collectives,
        "collectives_note": None if inp.collectives else inp.collectives_note,
        "ended_unix": inp.ended_unix,
        "problems": list(inp.problems),
    }


def merged_summary(
    world_size: int, inputs: list[RankInput], launch: dict[str, Any] | None, problems: list[str]
) -> dict[str, Any]:
    """The merged ``summary.json`` (docs/summary-json.md, "The merged summary of a multi-rank run")."""
    rows = [rank_row(i) for i in sorted(inputs, key=lambda i: i.rank)]
    first, why = failed_first(rows, launch)
    peak = imbalance(rows, "peak_memory_bytes")
    time = imbalance(rows, "step_time_ms")
    fits = [r["fits"] for r in rows]
    merged: dict[str, Any] = {
        "format_version": 1,
        "kind": "ranks",
        "memdoctor_version": __version__,
        "world_size": world_size,
        "ranks": rows,
        "status": "ok" if first is None else _row(rows, first)["status"],
        "all_fit": False if False in fits else (None if None in fits else True),
        "peak_memory_bytes": peak["max"] if peak else _only(rows, "peak_memory_bytes"),
        "step_time_ms": time["max"] if time else _only(rows, "step_time_ms"),
        "largest_peak_rank": peak["max_rank"] if peak else _only_rank(rows, "peak_memory_bytes"),
        "slowest_rank": time["max_rank"] if time else _only_rank(rows, "step_time_ms"),
        "imbalance": {"peak_memory_bytes": peak, "step_time_ms": time},
        "failed_first": first,
        "failed_first_why": why,
        "collectives": communication(rows),
        "problems": problems + [f"rank {r['rank']}: {p}" for r in rows for p in r["problems"]],
    }
    merged["headline"] = headline(merged)
    return merged


def imbalance(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """max/min of ``key`` over the ranks that measured it, with the ranks holding each; None with fewer
    than two such ranks. ``balanced``: max/min at most ``BALANCED``."""
    have = [(r[key], r["rank"]) for r in rows if r[key] is not None]
    if len(have) < 2:
        return None
    (top, top_rank), (low, low_rank) = max(have), min(have, key=lambda v: (v[0], -v[1]))
    ratio = round(top / low, 3) if low > 0 else None
    return {
        "max": top,
        "max_rank": top_rank,
        "min": low,
        "min_rank": low_rank,
        "max_over_min": ratio,
        "balanced": ratio is not None and ratio <= BALANCED,
    }


def failed_first(rows: list[dict[str, Any]], launch: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """The rank that failed first and why: the launcher's word (ranks.json) when it gave one, else the
    failed rank that ended earliest (its ``ended_s`` in ranks.json, else its trace's end time)."""
    if launch is not None and "failed_first" in launch:
        first = launch["failed_first"]
        if first is None:
            return None, None
        return first, launch.get("failed_first_why") or _why(_row(rows, first))
    failed = [r for r in rows if r["status"] in FAILED]
    if not failed:
        return None, None

    # ranks.json's ended_s (seconds since the launch) when it gives one for every failed rank, else
    # each trace's own end time: the two clocks are not mixed.
    entries = (launch or {}).get("ranks") or {}
    launched = [(entries.get(r["rank"]) or {}).get("ended_s") for r in failed]
    times = launched if all(_number(t) for t in launched) else [r["ended_unix"] for r in failed]
    order = [(float(t) if _number(t) else math.inf, r["rank"]) for t, r in zip(times, failed, strict=True)]
    row = _row(rows, min(order)[1])
    return row["rank"], _why(row)


def communication(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Time in collectives across ranks: the rank that spent the largest share of its step in them,
    and which ranks measured them at all."""
    measured = [r for r in rows if r["collectives"]]
    most = max(measured, key=lambda r: r["collectives"]["share_of_step"] or 0.0, default=None)
    return {
        "source": "measured" if measured else None,
        "measured_ranks": [r["rank"] for r in measured],
        "not_measured_ranks": [r["rank"] for r in rows if not r["collectives"]],
        "largest_share_rank": most["rank"] if most else None,
        "largest_share_of_step": most["collectives"]["share_of_step"] if most else None,
        "largest_ms_per_step": max((r["collectives"]["ms_per_step"] or 0.0 for r in measured), default=None),
    }


def headline(merged: dict[str, Any]) -> str:
    """The merged report's one sentence: who failed first, else that every rank finished; the largest
    peak, the slowest rank, and the imbalance when there is one."""
    n = merged["world_size"]
    parts = []
    if merged["failed_first"] is not None:
        parts.append(f"Rank {merged['failed_first']} of {n} failed first ({merged['failed_first_why']})")
    else:
        unknown = [r["rank"] for r in merged["ranks"] if r["status"] == UNKNOWN]
        known = f" (how rank{'s' if len(unknown) > 1 else ''} {_listed(unknown)} ended is unknown)"
        parts.append(f"{n} rank{'s' if n != 1 else ''}, none failed" + (known if unknown else ""))
    if merged["largest_peak_rank"] is not None and merged["peak_memory_bytes"] is not None:
        parts.append(
            f"largest peak {format_bytes(merged['peak_memory_bytes'])} on rank {merged['largest_peak_rank']}"
        )
    time = merged["imbalance"]["step_time_ms"]
    if time and time["max_over_min"] is not None:
        parts.append(
            f"slowest rank {time['max_rank']} at {time['max_over_min']:.2f}x the fastest's step time"
        )
    return "; ".join(parts) + "."


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _row(rows: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    return next(r for r in rows if r["rank"] == rank)


def _why(row: dict[str, Any]) -> str:
    return row["status"] + (f": {row['message']}" if row["message"] else "")


def _fits(status: str, peak: int | None, budget: int | None, measured: bool) -> bool | None:
    """A rank fit unless it ran out of memory or its peak is over its budget; None: nothing says."""
    if status == "oom":
        return False
    if peak is not None and budget is not None:
        return peak <= budget
    return True if measured else None


def _only(rows: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in rows if r[key] is not None), None)


def _only_rank(rows: list[dict[str, Any]], key: str) -> int | None:
    return next((r["rank"] for r in rows if r[key] is not None), None)


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> float:
    return float(value) if _number(value) and value >= 0 else 0.0


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _opt_int(value: Any) -> int | None:
    return int(value) if _number(value) else None


def _opt_float(value: Any) -> float | None:
    return float(value) if _number(value) else None


def _text(value: Any) -> str | None:
    return " ".join(value.split()) if isinstance(value, str) and value.strip() else None
