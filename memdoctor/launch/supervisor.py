"""The supervisor: runs the profiled script in a child process and always finishes the job.

Whatever happens to the child (it completes, stops after the requested steps, raises, runs out of
memory, calls ``sys.exit``, segfaults, is killed, or the user presses Ctrl-C), the supervisor reads
what the child wrote to the partial trace, adds an ``end`` record saying how the run ended, writes the
final trace atomically, and renders the report and ``summary.json`` from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.capture.collectors import parse_names
from memdoctor.errors import TraceError
from memdoctor.launch.childrun import INTERRUPT_KILL_S, ChildOutcome, deferred_stops, run_child
from memdoctor.launch.profile_child import ENV_VAR
from memdoctor.launch.rank_trace import rank_header
from memdoctor.launch.saving import failure_line, save_outputs
from memdoctor.outputs import display_path
from memdoctor.trace import (
    PARTIAL_SUFFIX,
    TRACE_FILENAME,
    Trace,
    load_trace,
    make_end,
    make_header,
    run_settings,
)
from memdoctor.trace.redact import redact_argv


@dataclass
class ProfileRequest:
    script: str | None
    module: str | None
    args: list[str]
    out_dir: Path
    warmup: int = 1
    steps: int = 5
    budget_bytes: int | None = None
    gpu: str | None = None  # the card planned for (``--gpu``, a ``memdoctor.cards`` key)
    timeout_s: float | None = None
    time_depth: int | None = None
    detail: str = "auto"
    collect: list[str] | str = "all"  # collector names (memdoctor.capture.collectors), or all / none
    progress: bool = False  # a "step k/N" bar on the terminal while the child runs
    # a memdoctor.yaml's content (``PlanConfig.as_dict()``) for the child to apply while profiling
    # (``profile --config``, ``--verify``); None profiles the script as it is
    config: dict[str, Any] | None = None
    # with ``config``: count what its checkpointed modules save as if they were not checkpointed (the
    # checkpoint-all re-profile, ``memdoctor.launch.reprofile``; ``memdoctor.levers.apply.SeeThrough``)
    see_checkpointed: bool = False
    # one rank of a ``torch.distributed.run`` job (``memdoctor.launch.rank_worker``): the header's
    # ``distributed`` (``memdoctor.launch.rank_trace.identity``), its backend filled in from the trace
    distributed: dict[str, Any] | None = None


@dataclass
class ProfileResult:
    exit_code: int
    status: str
    message: str
    trace_path: Path | None = None
    report_path: Path | None = None
    summary_path: Path | None = None
    summary: dict[str, Any] | None = None
    written: list[Path] = field(default_factory=list)
    output_error: str | None = None  # one line: the outputs that could not be written, and what was kept
    kept: Path | None = None  # where the measurements are (the trace, or the partial trace it left)
    end: dict[str, Any] | None = None  # the trace's end record: the script process's exit code, signal
    # when the script ended (Unix seconds): its fault, stop or exit event, else when its process exited;
    # what orders the ranks of a job by who failed first (memdoctor.launch.rank_outcome)
    ended_unix: float | None = None


# What the verify and re-profile rounds are given: a way to profile once more, and one to print a note.
Runner = Callable[[ProfileRequest], ProfileResult]
Say = Callable[[str], None]


def run_profile(req: ProfileRequest) -> ProfileResult:
    """Profile ``req.script`` (or ``req.module``) and write trace, report and summary to ``req.out_dir``."""
    trace_path = req.out_dir / TRACE_FILENAME
    partial = trace_path.with_name(trace_path.name + PARTIAL_SUFFIX)
    partial.unlink(missing_ok=True)
    outcome = _run_child(req, partial)
    exited_unix = time.time()
    trace = _salvage(partial, req)
    if req.distributed is not None:
        trace.header["distributed"] = rank_header(trace, req.distributed)
    status, code, message = classify(trace, outcome)
    trace.end = make_end(
        status=status,
        message=message,
        steps_recorded=sum(1 for s in trace.steps if s.complete),
        duration_s=outcome.duration_s,
        exit_code=outcome.returncode if outcome.returncode >= 0 else None,
        signal=_signal_name(outcome.returncode),
        memdoctor_exit_code=code,
    )
    with deferred_stops() as received:
        saved = save_outputs(trace, req.out_dir, partial)
    if received and code == exitcodes.OK:  # stopped once the run was over: the conventional code still
        code = exitcodes.SIGNAL_BASE + received[0]
    failure = failure_line(saved, sum(1 for s in trace.steps if s.complete))
    if status == "output_failed":  # one line: what happened, what was kept, where
        kept = f"; kept in {display_path(saved.kept)}" if saved.kept is not None and not failure else ""
        failure = f"{message}{kept}" + (f"; {failure}" if failure else "")
    paths = saved.paths
    summary = _read_json(paths.get("summary"))
    return ProfileResult(
        exit_code=exitcodes.USAGE_ERROR if failure and code == exitcodes.OK else code,
        status=status,
        message=message,
        trace_path=paths.get("trace"),
        report_path=paths.get("report"),
        summary_path=paths.get("summary"),
        summary=summary,
        written=list(paths.values()),
        output_error=failure,
        kept=saved.kept,
        end=trace.end,
        ended_unix=_ended_unix(trace, exited_unix),
    )


def _ended_unix(trace: Trace, exited_unix: float) -> float:
    """When the script ended: the time of the event that ended it (a rank blocked in a collective
    records its own fault only once the rank that failed has gone), else when its process exited."""
    t = (_terminal_event(trace) or {}).get("t_unix")
    return float(t) if isinstance(t, (int, float)) and 0 < t <= exited_unix else exited_unix


def child_command() -> list[str]:
    return [sys.executable, "-m", "memdoctor.launch.profile_child"]


def _child_env(req: ProfileRequest, partial: Path) -> dict[str, str]:
    cfg = {
        "trace_path": str(partial.resolve()),
        "script": req.script,
        "module": req.module,
        "args": req.args,
        "warmup": req.warmup,
        "steps": req.steps,
        "budget_bytes": req.budget_bytes,
        "gpu": req.gpu,
        "time_depth": req.time_depth,
        "detail": req.detail,
        "collect": req.collect if isinstance(req.collect, list) else parse_names(req.collect),
        "config": req.config,
        "see_checkpointed": req.see_checkpointed,
        "distributed": req.distributed,
        "command": {
            "argv": redact_argv(req.args),
            "script": req.script,
            "module": req.module,
            "cwd": os.getcwd(),
        },
    }
    env = dict(os.environ)
    env[ENV_VAR] = json.dumps(cfg)
    allocator = (req.config or {}).get("allocator")
    if allocator:
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator  # read once, when CUDA starts in the child
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_child(req: ProfileRequest, partial: Path) -> ChildOutcome:
    env = _child_env(req, partial)
    return run_child(child_command(), env, req.timeout_s, lambda: _progress(req, partial))


@contextlib.contextmanager
def _progress(req: ProfileRequest, partial: Path) -> Iterator[None]:
    """Show "step k/N" while the child runs, following its partial trace (``memdoctor.launch.progress``)."""
    if not req.progress:
        yield
        return
    from memdoctor.launch.progress import ProgressFollower, TerminalBar

    with TerminalBar(req.warmup, req.steps) as bar, ProgressFollower(partial, bar.update):
        yield


def _salvage(partial: Path, req: ProfileRequest) -> Trace:
    """What the child wrote, up to the last whole record; a bare header if it wrote nothing."""
    try:
        return load_trace(partial, salvage=True)
    except TraceError:
        header = make_header(
            memdoctor_version=_version(),
            created_unix=time.time(),
            command={
                "argv": redact_argv(req.args),
                "script": req.script,
                "module": req.module,
                "cwd": os.getcwd(),
            },
            settings=run_settings(req.warmup, req.steps, req.budget_bytes, req.gpu),
            host={},
            device={"kind": "unknown", "name": "unknown (the script died before memdoctor started)"},
            not_measured=["everything: the script process died before profiling started"],
        )
        header.pop("type")
        return Trace(header=header, truncated=partial.exists())


def classify(trace: Trace, outcome: ChildOutcome) -> tuple[str, int, str]:
    """(status, memdoctor exit code, one-line message) for how the run ended."""
    steps = sum(1 for s in trace.steps if s.complete)
    last = _terminal_event(trace) or {}
    kind = last.get("kind")
    if outcome.write_failed is not None:
        reason = outcome.write_failed.get("reason") or "a write error"
        return (
            "output_failed",
            exitcodes.USAGE_ERROR,
            f"the trace could not be written ({reason}) after {steps} complete steps: recording stopped "
            "and the script was stopped",
        )
    if outcome.timed_out:  # first: a signal that came while the timeout stopped the script came after it
        at = _where(last) if kind == "interrupted" else ""  # where it hung: a rank of a job, in a collective
        return (
            "timeout",
            exitcodes.TIMEOUT,
            f"--timeout expired after {steps} complete steps; the script was stopped{at}",
        )
    if outcome.stop_signal is not None and kind != "stopped":
        name = signal.Signals(outcome.stop_signal).name
        message = f"memdoctor received {name} after {steps} complete steps; the script was stopped"
        if outcome.escalated == "SIGKILL":
            message += " (it did not stop in time and was killed)"
        return "stopped", exitcodes.SIGNAL_BASE + outcome.stop_signal, message
    if kind == "stopped":
        return (
            "completed",
            exitcodes.OK,
            f"profiled {steps} steps ({sum(1 for s in trace.steps if s.complete and s.warmup)} warm-up)",
        )
    if kind == "interrupted" or outcome.interrupted:
        message = f"interrupted (Ctrl-C) after {steps} complete steps"
        if kind != "interrupted" and outcome.escalated == "SIGKILL":
            message += f"; the script did not stop within {INTERRUPT_KILL_S:g} s and was killed"
        return "interrupted", exitcodes.INTERRUPTED, message
    if kind == "config_error":
        return "config_error", exitcodes.USAGE_ERROR, f"the plan could not be applied: {last['message']}"
    if kind == "oom":
        return "oom", exitcodes.OUT_OF_MEMORY, _where_message("ran out of memory", last, steps)
    if kind == "exception":
        return "exception", exitcodes.SCRIPT_FAILED, _where_message(f"raised {last['message']}", last, steps)
    if kind in ("script_finished", "script_exit"):
        return _ended(kind, last, steps)
    return _died(outcome.returncode, steps)


def _ended(kind: str, last: dict[str, Any], steps: int) -> tuple[str, int, str]:
    code = last.get("exit_code") or exitcodes.SCRIPT_OK
    how = "finished" if kind == "script_finished" else f"called sys.exit({code})"
    if code != exitcodes.SCRIPT_OK:
        return "script_exit", exitcodes.SCRIPT_FAILED, f"the script {how} after {steps} complete steps"
    if steps == 0:
        message = f"the script {how} without a training step (no backward)"
        if last.get("processes_started"):
            n = last["processes_started"]
            message += (
                f"; it started {n} process{'' if n == 1 else 'es'} (multiprocessing), and training that "
                "runs in another process is not profiled: profile a run that trains in its main process"
            )
        return "no_steps", exitcodes.NO_STEPS, message
    status = "script_finished" if kind == "script_finished" else "script_exit"
    return status, exitcodes.OK, f"the script {how} after {steps} complete steps"


def _died(returncode: int, steps: int) -> tuple[str, int, str]:
    if returncode < 0:
        name = _signal_name(returncode) or f"signal {-returncode}"
        status = "crashed" if name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT") else "killed"
        return (
            status,
            exitcodes.SCRIPT_FAILED,
            f"the script process died of {name} after {steps} complete steps",
        )
    return (
        "crashed",
        exitcodes.SCRIPT_FAILED,
        f"the script process exited abruptly (code {returncode}, no Python exception) "
        f"after {steps} complete steps",
    )


def _where_message(what: str, ev: dict[str, Any], steps: int) -> str:
    return f"the script {what}{_where(ev)} ({steps} complete steps recorded)"


def _where(ev: dict[str, Any]) -> str:
    """`` at step K in PHASE of MODULE`` from an event's where (what of it is known), or ``""``."""
    parts = []
    if ev.get("step") is not None:
        parts.append(f"at step {ev['step']}")
    if ev.get("phase") and ev["phase"] != "other":
        parts.append(f"in {ev['phase']}")
    if ev.get("module_name"):
        parts.append(f"of {ev['module_name']}")
    return "".join(f" {p}" for p in parts)


_TERMINAL_KINDS = frozenset(
    ("stopped", "interrupted", "oom", "exception", "script_finished", "script_exit", "config_error")
)


def _terminal_event(trace: Trace) -> dict[str, Any] | None:
    for ev in reversed(trace.events):
        if ev.get("kind") in _TERMINAL_KINDS:
            return ev
    return None


def _signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return None


def _read_json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def _version() -> str:
    from memdoctor.version import __version__

    return __version__
