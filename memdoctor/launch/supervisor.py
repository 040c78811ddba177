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
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.capture.collectors import parse_names
from memdoctor.errors import TraceError
from memdoctor.launch.profile_child import ENV_VAR
from memdoctor.trace import (
    PARTIAL_SUFFIX,
    TRACE_FILENAME,
    Trace,
    load_trace,
    make_end,
    make_header,
    save_trace,
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
    timeout_s: float | None = None
    time_depth: int | None = None
    detail: str = "auto"
    collect: list[str] | str = "all"  # collector names (memdoctor.capture.collectors), or all / none
    progress: bool = False  # a "step k/N" bar on the terminal while the child runs
    # a memdoctor.yaml's content (``PlanConfig.as_dict()``) for the child to apply while profiling
    # (``profile --config``, ``--verify``); None profiles the script as it is
    config: dict[str, Any] | None = None


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


# What the verify and re-profile rounds are given: a way to profile once more, and one to print a note.
Runner = Callable[[ProfileRequest], ProfileResult]
Say = Callable[[str], None]


@dataclass
class _ChildOutcome:
    returncode: int
    interrupted: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    interrupted_at: float | None = None  # time.monotonic() of the first Ctrl-C
    escalated: str | None = None  # what the supervisor had to send after Ctrl-C: "SIGINT", "SIGKILL"


# After Ctrl-C the child normally records what it has and exits within a second or two. One that has
# not after INTERRUPT_FORWARD_S gets a SIGINT of its own (a Ctrl-C sent to memdoctor's process only,
# ``kill -INT``, never reached it); one still running after INTERRUPT_KILL_S is killed, and the trace
# keeps every step it had flushed: Ctrl-C must always end the run promptly and leave its outputs.
INTERRUPT_FORWARD_S = 5.0
INTERRUPT_KILL_S = 20.0
TIMEOUT_GRACE_S = 15.0  # --timeout: the child gets a Ctrl-C, and this long to record before it is killed
_POLL_S = 0.25


def run_profile(req: ProfileRequest) -> ProfileResult:
    """Profile ``req.script`` (or ``req.module``) and write trace, report and summary to ``req.out_dir``."""
    trace_path = req.out_dir / TRACE_FILENAME
    partial = trace_path.with_name(trace_path.name + PARTIAL_SUFFIX)
    partial.unlink(missing_ok=True)
    outcome = _run_child(req, partial)
    trace = _salvage(partial, req)
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
    save_trace(trace, trace_path)
    partial.unlink(missing_ok=True)
    from memdoctor.report import write_report

    paths = write_report(trace, req.out_dir)
    summary = _read_json(paths.get("summary"))
    return ProfileResult(
        exit_code=code,
        status=status,
        message=message,
        trace_path=trace_path,
        report_path=paths.get("report"),
        summary_path=paths.get("summary"),
        summary=summary,
        written=[trace_path, *paths.values()],
    )


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
        "time_depth": req.time_depth,
        "detail": req.detail,
        "collect": req.collect if isinstance(req.collect, list) else parse_names(req.collect),
        "config": req.config,
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


def _run_child(req: ProfileRequest, partial: Path) -> _ChildOutcome:
    start = time.monotonic()
    proc = subprocess.Popen(child_command(), env=_child_env(req, partial))
    outcome = _ChildOutcome(returncode=0)
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        # The terminal sends Ctrl-C to the child too; it records what it has and exits (_wait makes
        # sure it does). A second Ctrl-C stops it at once.
        if outcome.interrupted:
            proc.kill()
        else:
            outcome.interrupted_at = time.monotonic()
        outcome.interrupted = True

    signal.signal(signal.SIGINT, on_sigint)
    try:
        with _progress(req, partial):
            outcome.returncode = _wait(proc, req.timeout_s, outcome)
    finally:
        signal.signal(signal.SIGINT, previous)
    outcome.duration_s = time.monotonic() - start
    return outcome


@contextlib.contextmanager
def _progress(req: ProfileRequest, partial: Path) -> Iterator[None]:
    """Show "step k/N" while the child runs, following its partial trace (``memdoctor.launch.progress``)."""
    if not req.progress:
        yield
        return
    from memdoctor.launch.progress import ProgressFollower, TerminalBar

    with TerminalBar(req.warmup, req.steps) as bar, ProgressFollower(partial, bar.update):
        yield


def _wait(proc: subprocess.Popen[bytes], timeout_s: float | None, outcome: _ChildOutcome) -> int:
    """The child's exit status; it is stopped when ``timeout_s`` expires or it outlives a Ctrl-C."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            # short waits: a Ctrl-C (on_sigint) only sets a flag, and this loop acts on it
            return proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            if outcome.interrupted_at is not None:  # --timeout does not override a Ctrl-C in progress
                if time.monotonic() - outcome.interrupted_at >= INTERRUPT_FORWARD_S:
                    return _stop_child(proc, INTERRUPT_KILL_S - INTERRUPT_FORWARD_S, outcome)
            elif deadline is not None and time.monotonic() >= deadline:
                outcome.timed_out = True
                return _stop_child(proc, TIMEOUT_GRACE_S, outcome)


def _stop_child(proc: subprocess.Popen[bytes], grace_s: float, outcome: _ChildOutcome) -> int:
    """Ask the child to stop as Ctrl-C would (so it records what it has), then kill it after
    ``grace_s``; ``outcome.escalated`` says how far it went."""
    outcome.escalated = "SIGINT"
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        outcome.escalated = "SIGKILL"
        proc.kill()
        return proc.wait()


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
            settings={"warmup": req.warmup, "steps": req.steps, "budget_bytes": req.budget_bytes},
            host={},
            device={"kind": "unknown", "name": "unknown (the script died before memdoctor started)"},
            not_measured=["everything: the script process died before profiling started"],
        )
        header.pop("type")
        return Trace(header=header, truncated=partial.exists())


def classify(trace: Trace, outcome: _ChildOutcome) -> tuple[str, int, str]:
    """(status, memdoctor exit code, one-line message) for how the run ended."""
    steps = sum(1 for s in trace.steps if s.complete)
    last = _terminal_event(trace) or {}
    kind = last.get("kind")
    if outcome.timed_out:
        return (
            "timeout",
            exitcodes.TIMEOUT,
            f"--timeout expired after {steps} complete steps; the script was stopped",
        )
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
    parts = [f"the script {what}"]
    if ev.get("step") is not None:
        parts.append(f"at step {ev['step']}")
    if ev.get("phase") and ev["phase"] != "other":
        parts.append(f"in {ev['phase']}")
    if ev.get("module_name"):
        parts.append(f"of {ev['module_name']}")
    return " ".join(parts) + f" ({steps} complete steps recorded)"


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
