"""Running the supervised child to its end, whatever arrives meanwhile: Ctrl-C, ``--timeout``, a SIGTERM
or SIGHUP to memdoctor (``timeout``, Slurm, ``docker stop``, a closed terminal), or a failed trace write.

Each stop goes the same way: the child is asked over the control socket (``memdoctor.launch.control``)
to stop as on Ctrl-C, saying why, so that the script's ``KeyboardInterrupt`` runs and memdoctor records
where it was; a child still running after the grace is killed, and the trace keeps every step it had
flushed. A second signal kills the child at once. The supervisor then writes the report as usual:
a signal is a stop, not a loss.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memdoctor.launch import control

# After Ctrl-C the child normally records what it has and exits within a second or two. One that has
# not after INTERRUPT_FORWARD_S is asked to stop (a Ctrl-C sent to memdoctor's process only,
# ``kill -INT``, never reached it); one still running after INTERRUPT_KILL_S is killed, and the trace
# keeps every step it had flushed: Ctrl-C must always end the run promptly and leave its outputs.
INTERRUPT_FORWARD_S = 5.0
INTERRUPT_KILL_S = 20.0
TIMEOUT_GRACE_S = 15.0  # --timeout, SIGTERM, SIGHUP: the child's time to record before it is killed
_POLL_S = 0.25
# The signals that stop a run: SIGINT (Ctrl-C), SIGTERM (timeout, Slurm, docker stop), SIGHUP (the
# terminal closed); SIGHUP does not exist on Windows.
STOP_SIGNALS = tuple(
    s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s
)


@dataclass
class ChildOutcome:
    returncode: int
    interrupted: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    interrupted_at: float | None = None  # time.monotonic() of the first Ctrl-C
    escalated: str | None = None  # what the supervisor had to send after Ctrl-C: "SIGINT", "SIGKILL"
    stop_signal: int | None = None  # SIGTERM or SIGHUP received by memdoctor: the run was stopped
    stop_at: float | None = None  # time.monotonic() of that signal
    write_failed: dict[str, Any] | None = None  # the child could not write the trace (control message)


def run_child(
    command: list[str], env: dict[str, str], timeout_s: float | None, watch: Callable[[], Any]
) -> ChildOutcome:
    """Start ``command`` with the control socket, wait for it (see the module docstring), and say how
    it ended. ``watch`` is a context manager entered while it runs (the progress bar)."""
    start = time.monotonic()
    ours, theirs = control.socket_pair()
    env = {**env, control.ENV_VAR: f"{theirs.fileno()}:{os.getpid()}"}
    try:
        proc = subprocess.Popen(command, env=env, pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()
    outcome = ChildOutcome(returncode=0)
    try:
        with _stop_signals(proc, outcome), watch():
            outcome.returncode = _wait(proc, ours, timeout_s, outcome)
        for msg in control.receive_all(ours):
            if isinstance(msg.get("write_failed"), dict):
                outcome.write_failed = msg["write_failed"]
    finally:
        ours.close()
    outcome.duration_s = time.monotonic() - start
    return outcome


@contextlib.contextmanager
def _stop_signals(proc: subprocess.Popen[bytes], outcome: ChildOutcome) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP only set flags here (``_wait`` acts on them); a second one kills
    the child at once. The previous handlers come back when the child has exited."""

    def on_signal(signum: int, frame: Any) -> None:
        if outcome.interrupted or outcome.stop_signal is not None:
            proc.kill()
        if signum == signal.SIGINT:
            # The terminal sends Ctrl-C to the child too; it records what it has and exits.
            if outcome.interrupted_at is None:
                outcome.interrupted_at = time.monotonic()
            outcome.interrupted = True
        elif outcome.stop_signal is None:
            outcome.stop_signal, outcome.stop_at = signum, time.monotonic()

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_stops() -> Iterator[list[int]]:
    """While the outputs are written: a SIGTERM or SIGHUP is noted (the list it yields) rather than
    killing memdoctor between the trace and the report; they take a second or two. Ctrl-C still
    interrupts (a user who will not wait keeps the trace, saved first)."""
    received: list[int] = []
    deferred = [s for s in STOP_SIGNALS if s != signal.SIGINT]
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in deferred}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(proc: subprocess.Popen[bytes], sock: Any, timeout_s: float | None, outcome: ChildOutcome) -> int:
    """The child's exit status; it is stopped when ``timeout_s`` expires, memdoctor is signalled, or it
    outlives a Ctrl-C."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            # short waits: a signal handler only sets a flag, and this loop acts on it
            return proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if outcome.stop_signal is not None:
                name = signal.Signals(outcome.stop_signal).name
                return stop_child(proc, sock, f"stopped: memdoctor received {name}", TIMEOUT_GRACE_S, outcome)
            if outcome.interrupted_at is not None:  # --timeout does not override a Ctrl-C in progress
                if now - outcome.interrupted_at >= INTERRUPT_FORWARD_S:
                    grace = INTERRUPT_KILL_S - INTERRUPT_FORWARD_S
                    return stop_child(proc, sock, "interrupted (Ctrl-C)", grace, outcome)
            elif deadline is not None and now >= deadline:
                outcome.timed_out = True
                return stop_child(proc, sock, "stopped: --timeout expired", TIMEOUT_GRACE_S, outcome)


def stop_child(
    proc: subprocess.Popen[bytes], sock: Any, reason: str, grace_s: float, outcome: ChildOutcome
) -> int:
    """Ask the child to stop as Ctrl-C would, saying why (so it records what it has and names the
    cause), then kill it after ``grace_s``; ``outcome.escalated`` says how far it went."""
    outcome.escalated = "SIGINT"
    if not control.send(sock, {"stop": reason}):  # no watcher to ask: the signal itself
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        outcome.escalated = "SIGKILL"
        proc.kill()
        return proc.wait()
