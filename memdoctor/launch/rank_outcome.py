"""A multi-process job's outcome: each rank's, which rank failed first and why, and the exit code.

Each rank reports how it ended (``memdoctor.launch.rank_worker``). A rank that could not (its
supervisor was killed) is read from what it left: its final trace, else its partial trace, finished
here with an ``end`` saying it was killed, so that every rank's measurements stay readable.

The rank that failed first is the first to end abnormally, by the time its script ended: its fault
event's time when it recorded one (the exception, the OOM, the stop), else when its process exited. A
rank blocked in a collective records its own error only once the failed rank's process has gone, and
the ranks ``torch.distributed.run`` tears down afterwards end later still, so the first by time is the
cause. The command's exit code is that rank's, as ``memdoctor profile`` gives it for one process.

``memdoctor profile`` writes ``OUT/ranks.json`` (``docs/distributed.md``) and then the merged report
(``memdoctor.report.ranks.write_merged``) over ``OUT/rank-K/``.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.errors import MemdoctorError, TraceError
from memdoctor.launch.childrun import deferred_stops
from memdoctor.launch.rank_trace import rank_header
from memdoctor.launch.rank_worker import rank_folder
from memdoctor.launch.ranks import Launched, RankJob, launch
from memdoctor.launch.saving import save_outputs
from memdoctor.outputs import atomic_write
from memdoctor.trace import PARTIAL_SUFFIX, TRACE_FILENAME, load_trace, make_end
from memdoctor.trace.records import distributed_of

RANKS_FILENAME = "ranks.json"
STATUSES = ("ok", "oom", "exception", "timeout", "interrupted", "killed")
# a one-process run's status (memdoctor.launch.supervisor.classify) as a rank's, when it failed
_FAILED_STATUS = {
    "oom": "oom",
    "timeout": "timeout",
    "interrupted": "interrupted",
    "stopped": "killed",
    "killed": "killed",
    "crashed": "killed",
}


@dataclass
class RankEntry:
    """One rank in ``ranks.json``."""

    rank: int
    status: str  # one of STATUSES
    exit_code: int | None  # the script process's (None when it left none)
    signal: str | None  # the signal that ended the script process
    message: str
    trace: str | None  # relative to OUT: rank-K/trace.jsonl.gz (or its .partial), None when none is left
    ended_s: float | None  # when the script ended, in seconds since the job started
    local_rank: int | None = None
    end_status: str | None = None  # the one-process status it stands for (docs/summary-json.md)
    memdoctor_exit_code: int = exitcodes.OK  # what memdoctor profile returns for this rank alone


@dataclass
class RanksResult:
    exit_code: int
    world_size: int
    entries: list[RankEntry]
    failed_first: int | None = None
    failed_first_why: str | None = None
    written: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each, for the terminal

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "ranks": [asdict(e) for e in self.entries],
            "failed_first": self.failed_first,
            "failed_first_why": self.failed_first_why,
        }


def profile_ranks(request: Any, job: RankJob) -> RanksResult:
    """Profile every rank of the job into ``request.out_dir`` (a ``ProfileRequest`` for one process,
    its ``out_dir`` the job's folder), then write ``ranks.json`` and the merged report."""
    out_dir = Path(request.out_dir)
    cfg = {"mode": "profile", "out_dir": str(out_dir.resolve()), "request": _request_fields(request)}
    launched = launch(job, cfg, request.timeout_s)
    with deferred_stops():
        entries = [profile_entry(out_dir, rank, launched) for rank in _ranks(job, launched)]
        result = summarise(job, entries, launched)
        path = out_dir / RANKS_FILENAME
        atomic_write(path, json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n")
        result.written.append(path)
        result.written += [rank_folder(out_dir, e.rank) for e in entries if e.trace is not None]
        result.notes += merged_report(out_dir, result)
    return result


def run_ranks(
    config_path: Path, script: str | None, module: str | None, args: list[str], job: RankJob
) -> RanksResult:
    """``memdoctor run`` on every rank of the job; the exit code is the first failed rank's."""
    cfg: dict[str, Any] = {"mode": "run", "config_path": str(config_path.resolve()), "args": args}
    cfg.update(script=script, module=module)
    launched = launch(job, cfg, None)
    entries = [_run_entry(rank, launched) for rank in _ranks(job, launched)]
    return summarise(job, entries, launched)


def _request_fields(request: Any) -> dict[str, Any]:
    """What a rank's ``ProfileRequest`` shares with the one-process request (its folder and rank are
    its own; no progress bar: N ranks share one terminal)."""
    keys = "script module args warmup steps budget_bytes gpu timeout_s time_depth detail collect config"
    return {k: getattr(request, k) for k in keys.split()}


def _ranks(job: RankJob, launched: Launched) -> list[int]:
    return sorted(set(job.local_ranks()) | set(launched.lines))


def _rank_status(status: str, code: int) -> str:
    if code == exitcodes.OK:
        return "ok"
    return _FAILED_STATUS.get(status, "exception")


def profile_entry(out_dir: Path, rank: int, launched: Launched) -> RankEntry:
    """Rank ``rank``'s entry: as it told, or from what it left in ``OUT/rank-K`` (``_left_behind``)."""
    line = launched.lines.get(rank)
    told = line.result if line is not None else None
    if told is None:
        entry = _left_behind(out_dir, rank, launched.started_unix)
        ended = line.closed_unix if line is not None else None
    else:
        code = int(told.get("exit_code", exitcodes.SCRIPT_FAILED))
        entry = RankEntry(
            rank=rank,
            status=_rank_status(str(told.get("status")), code),
            exit_code=told.get("script_exit_code"),
            signal=told.get("signal"),
            message=str(told.get("message", "")),
            trace=_trace_of(out_dir, rank, launched.started_unix),
            ended_s=None,
            end_status=told.get("status"),
            memdoctor_exit_code=code,
        )
        ended = told.get("ended_unix")
    entry.local_rank = line.hello.get("local_rank") if line is not None else None
    entry.ended_s = _since(ended, launched.started_unix)
    return entry


def _run_entry(rank: int, launched: Launched) -> RankEntry:
    line = launched.lines.get(rank)
    told = (line.result if line is not None else None) or {}
    code = int(told.get("exit_code", exitcodes.SCRIPT_FAILED))
    default = "the rank never started"
    if line is not None:
        default = "the rank ended without saying how (its supervisor was killed)"
    return RankEntry(
        rank=rank,
        status=_rank_status(str(told.get("status", "killed")), code),
        exit_code=told.get("script_exit_code"),
        signal=told.get("signal"),
        message=str(told.get("message", default)),
        trace=None,
        ended_s=_since(told.get("ended_unix") or (line.closed_unix if line else None), launched.started_unix),
        local_rank=line.hello.get("local_rank") if line is not None else None,
        end_status=told.get("status"),
        memdoctor_exit_code=code,
    )


def _trace_of(out_dir: Path, rank: int, since_unix: float) -> str | None:
    folder = rank_folder(out_dir, rank)
    for name in (TRACE_FILENAME, TRACE_FILENAME + PARTIAL_SUFFIX):
        if _written_since(folder / name, since_unix):
            return f"{folder.name}/{name}"
    return None


def _written_since(path: Path, since_unix: float) -> bool:
    """``path`` is a file this job wrote, not one a run before it left (``--force`` into an old folder)."""
    try:
        return path.is_file() and path.stat().st_mtime >= since_unix - 1.0
    except OSError:
        return False


def _left_behind(out_dir: Path, rank: int, started_unix: float) -> RankEntry:
    """A rank that did not report: its final trace if it wrote one, else its partial trace finished
    here (an ``end`` saying it was killed, the report and summary written), else nothing."""
    folder = rank_folder(out_dir, rank)
    final, partial = folder / TRACE_FILENAME, folder / (TRACE_FILENAME + PARTIAL_SUFFIX)
    entry = RankEntry(rank, "killed", None, None, "", None, None, end_status="killed")
    entry.memdoctor_exit_code = exitcodes.SCRIPT_FAILED
    try:
        if _written_since(partial, started_unix):
            trace = load_trace(partial, salvage=True)
            rank_identity = distributed_of(trace.header)
            if rank_identity is not None:  # its supervisor would have named the backend
                trace.header["distributed"] = rank_header(trace, rank_identity)
            steps = sum(1 for s in trace.steps if s.complete)
            entry.message = f"the rank was killed after {steps} complete steps, before it finished its trace"
            trace.end = make_end(
                status="killed",
                message=entry.message,
                steps_recorded=steps,
                duration_s=0.0,
                memdoctor_exit_code=exitcodes.SCRIPT_FAILED,
            )
            save_outputs(trace, folder, partial)
        elif _written_since(final, started_unix):  # written, then killed before it could say so
            end = load_trace(final).end or {}
            entry.end_status = str(end.get("status"))
            entry.memdoctor_exit_code = int(end.get("memdoctor_exit_code") or exitcodes.SCRIPT_FAILED)
            entry.status = _rank_status(entry.end_status, entry.memdoctor_exit_code)
            entry.message = str(end.get("message") or "the rank ended without reporting")
            entry.exit_code, entry.signal = end.get("exit_code"), end.get("signal")
        else:
            entry.message = "the rank left no trace: it ended before its script started"
    except (TraceError, MemdoctorError, OSError) as exc:
        entry.message = f"the rank was killed and its trace cannot be read ({' '.join(str(exc).split())})"
    entry.trace = _trace_of(out_dir, rank, started_unix)
    return entry


def _since(when: Any, started_unix: float) -> float | None:
    if not isinstance(when, (int, float)):
        return None
    return round(max(0.0, float(when) - started_unix), 3)


def summarise(job: RankJob, entries: list[RankEntry], launched: Launched) -> RanksResult:
    """The job's result: which rank failed first (see the module docstring), and its exit code. A
    rank that memdoctor itself stopped (Ctrl-C, SIGTERM, a job past --timeout) did not fail."""
    stopped_s = _since(launched.stopped_unix, launched.started_unix)
    failed = [e for e in entries if e.status != "ok" and not _stopped_by_us(e, stopped_s)]
    result = RanksResult(exit_code=exitcodes.OK, world_size=job.world_size, entries=entries)
    if stopped_s is not None and not failed:
        result.exit_code, result.failed_first_why = _stop(launched)
    if failed:
        first = min(failed, key=lambda e: (e.ended_s is None, e.ended_s or 0.0, e.rank))
        result.failed_first = first.rank
        result.failed_first_why = f"rank {first.rank} {first.status}: {first.message}"
        result.exit_code = first.memdoctor_exit_code or exitcodes.SCRIPT_FAILED
        for e in failed:
            if e is not first:
                e.message += f" (after rank {first.rank} had failed)"
    if not launched.lines and launched.launcher_code != 0:
        code = launched.launcher_code
        result.notes.append(f"torch.distributed.run ended (code {code}) before any rank started (above: why)")
    if launched.forced:
        result.notes.append("the job outlived --timeout and was stopped by memdoctor")
    if launched.swept:
        result.notes.append(f"killed what was left of {launched.swept} process group(s) of the job")
    return result


def _stopped_by_us(entry: RankEntry, stopped_s: float | None) -> bool:
    if stopped_s is None or entry.status not in ("interrupted", "killed"):
        return False
    return entry.ended_s is None or entry.ended_s >= stopped_s


def _stop(launched: Launched) -> tuple[int, str]:
    """The exit code and the line of a job memdoctor stopped before any rank failed."""
    if launched.signals:
        signum = launched.signals[0]
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        return exitcodes.SIGNAL_BASE + signum, f"no rank failed: memdoctor received {name} and stopped them"
    return exitcodes.TIMEOUT, "no rank failed: the job outlived --timeout and memdoctor stopped it"


def merged_report(out_dir: Path, result: RanksResult) -> list[str]:
    """The merged report over the ranks' folders; the notes to print when it cannot be written."""
    from memdoctor.report.ranks import write_merged

    try:
        write_merged(out_dir)
    except (MemdoctorError, OSError) as exc:
        return [f"the merged report could not be written: {' '.join(str(exc).split())}"]
    result.written += [p for p in (out_dir / "summary.json", out_dir / "report.html") if p.is_file()]
    return []


def outcome_lines(result: RanksResult) -> list[str]:
    """One line per rank, then the first failure: what the terminal shows."""
    lines = []
    for e in result.entries:
        where = f" ({e.trace})" if e.trace else ""
        when = f" at {e.ended_s:.1f} s" if e.ended_s is not None else ""
        lines.append(f"rank {e.rank}: {e.status}{when}: {e.message}{where}")
    if result.failed_first is not None:
        lines.append(f"failed first: {result.failed_first_why}")
    elif result.failed_first_why:
        lines.append(result.failed_first_why)
    return lines
