"""Nothing lost, nothing left running: memdoctor stopped by a signal, killed, crowded, or out of disk.

End to end, with a real supervised child each (tiny CPU scripts, a few steps): SIGTERM, SIGHUP and
SIGINT to memdoctor stop the run and keep it; a ``kill -9`` of memdoctor stops its child, whose trace
stays salvageable; two profiles into one folder never share it; a full disk stops recording without
raising into the script. The in-process parts of the same promises: ``tests/test_run_guards.py``.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_faults import CHILD_ENV, Run, fault_script, make_dirs, profile, tree

from memdoctor import exitcodes
from memdoctor.trace import load_trace

pytestmark = pytest.mark.slow

# Marks (in its cwd's parent, as "ready") that it has run two steps, writing its pid there, then runs
# on; bounded, so that a run never stopped fails its test as "script_finished" instead of hanging.
RUNS_ON = """\
for step in range(3000):
    train_step()
    if step == 1:
        with open(os.path.join(os.path.dirname(os.getcwd()), "ready.tmp"), "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(os.path.join(os.path.dirname(os.getcwd()), "ready.tmp"),
                   os.path.join(os.path.dirname(os.getcwd()), "ready"))
    time.sleep(0.01)
"""


def _wait_for(path: Path, seconds: float = 120) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def _signal_when_ready(ready: Path, signum: int) -> threading.Thread:
    """Send ``signum`` to this process (memdoctor, run in-process) once the script has run two steps."""

    def send() -> None:
        if _wait_for(ready):
            os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_memdoctor_stops_the_run_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: signal.Signals
) -> None:
    from memdoctor.launch import childrun

    monkeypatch.setattr(childrun, "INTERRUPT_FORWARD_S", 0.5)  # SIGINT to memdoctor alone: forwarded
    sender = _signal_when_ready(tmp_path / "ready", signum)
    run = profile(tmp_path, fault_script(RUNS_ON), "--warmup", "1", "--steps", "100000")
    sender.join(5)
    assert (tmp_path / "ready").exists(), "the script never reached step 2"
    assert run.code == 128 + signum
    end = run.end()
    run.assert_outputs()
    assert run.complete_steps()[:2] == [0, 1]
    assert end["memdoctor_exit_code"] == 128 + signum
    stops = [e["message"] for e in run.trace.events if e.get("kind") == "interrupted"]
    if signum == signal.SIGINT:
        assert end["status"] == "interrupted" and stops == ["interrupted (Ctrl-C)"]
    else:  # the child stopped as on Ctrl-C, and says why
        assert end["status"] == "stopped" and f"memdoctor received {signum.name}" in end["message"]
        assert stops == [f"stopped: memdoctor received {signum.name}"]
        assert run.summary["headline"].startswith(f"The run was stopped by {signum.name} sent to memdoctor")
    assert not _alive(int((tmp_path / "ready").read_text()))
    run.assert_clean()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_child_stops_when_memdoctor_is_killed(tmp_path: Path) -> None:
    script = make_dirs(tmp_path, fault_script(RUNS_ON))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--steps", "100000", "--timeout", "3600"]
    proc = subprocess.Popen(
        [*cmd, "-o", str(out), str(script)],
        cwd=tmp_path / "cwd",
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    child = None
    try:
        assert _wait_for(tmp_path / "ready"), "the script never reached step 2"
        child = int((tmp_path / "ready").read_text())
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # the orphan would otherwise train on for 3000 steps
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the script outlived memdoctor"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    partial = out / "trace.jsonl.gz.partial"
    trace = load_trace(partial, salvage=True)
    assert [s.step for s in trace.steps if s.complete][:2] == [0, 1]
    stops = [e["message"] for e in trace.events if e.get("kind") == "interrupted"]
    assert stops == [f"stopped: memdoctor (pid {proc.pid}) ended while the script ran"]


# --------------------------------------------------------------------------------- one run, one folder

STEPS_SCRIPT = """\
for step in range(6):
    train_step()
    if step == 1:
        open(os.path.join(os.path.dirname(os.getcwd()), "ready"), "w").close()
    time.sleep(0.3)
"""


def _start(tmp_path: Path, script: Path, *options: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--warmup", "1", "--steps", "4", *options]
    return subprocess.Popen(
        [*cmd, str(script)],
        cwd=tmp_path / "cwd",
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("explicit", [False, True], ids=["default_folder", "explicit_folder"])
def test_two_profiles_never_share_a_folder(tmp_path: Path, explicit: bool) -> None:
    script = make_dirs(tmp_path, fault_script(STEPS_SCRIPT))
    options = ("-o", str(tmp_path / "cwd" / "memdoctor-report")) if explicit else ()
    first = _start(tmp_path, script, *options)
    try:
        assert _wait_for(tmp_path / "ready"), "the first run never reached step 2"
        second = _start(tmp_path, script, *options)  # while the first one writes its trace
        code2, err2 = _finish(second)
    finally:
        code1, err1 = _finish(first)
    assert code1 == exitcodes.OK, err1
    folder = tmp_path / "cwd" / "memdoctor-report"
    first_run = Run(code1, tmp_path, folder, set())
    first_run.assert_outputs()
    assert first_run.end()["status"] == "completed" and len(first_run.complete_steps()) == 5
    if explicit:  # refused at once, naming the run that holds the folder; the first run's files intact
        assert code2 == exitcodes.USAGE_ERROR
        lines = [line for line in err2.splitlines() if line.strip()]
        assert len(lines) == 1, err2
        assert f"in use by memdoctor profile (pid {first.pid}" in lines[0]
    else:  # the next free folder, and a line saying so
        assert code2 == exitcodes.OK, err2
        assert "memdoctor-report is in use by another memdoctor run; writing to memdoctor-report-1" in err2
        second_run = Run(code2, tmp_path, tmp_path / "cwd" / "memdoctor-report-1", set())
        second_run.assert_outputs()
        assert second_run.end()["status"] == "completed" and len(second_run.complete_steps()) == 5
    assert not list((tmp_path / "cwd").glob("*/.memdoctor.lock"))  # released by both


# ----------------------------------------------------------------------------------------- disk full

# The script fills "the disk" under memdoctor: from its NTH trace record on, half a record reaches the
# file and the write fails with ENOSPC (patched in the child, where the trace is written).
DISK_FULL = """\
import errno
from memdoctor.trace.writer import TraceWriter

_append, _count = TraceWriter._append, [0]


def _full(self, member):
    _count[0] += 1
    if _count[0] >= NTH:
        self._fh.write(member[: len(member) // 2])
        self._fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")
    _append(self, member)


TraceWriter._append = _full
try:
    for step in range(50):
        train_step()
finally:
    print("the script's finally ran")
print("the script ran on")
"""


def test_a_full_disk_during_the_run_stops_recording_and_never_raises_into_the_script(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = profile(tmp_path, fault_script("NTH = 9\n" + DISK_FULL), "--warmup", "1", "--steps", "30")
    out, err = capfd.readouterr()
    assert run.code == exitcodes.USAGE_ERROR
    assert "Traceback" not in err and "this is a bug" not in err
    assert "the script's finally ran" not in out and "ran on" not in out  # stopped cleanly, as at --steps
    lines = [line for line in err.splitlines() if line.startswith("memdoctor: error:")]
    assert len(lines) == 1, err
    assert "the trace could not be written (No space left on device)" in lines[0]
    assert "recording stopped and the script was stopped" in lines[0] and "kept in" in lines[0]
    end = run.end()
    assert end["status"] == "output_failed" and end["memdoctor_exit_code"] == exitcodes.USAGE_ERROR
    kept = run.complete_steps()
    assert kept and kept == list(range(len(kept)))  # every step written before the failure
    run.assert_outputs()
    run.assert_clean()


def test_a_full_disk_when_saving_says_what_was_kept_and_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from memdoctor.launch import saving

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "save_trace", full)
    body = "for _ in range(3):\n    train_step()\n"
    run = profile(tmp_path, fault_script(body), "--warmup", "1", "--steps", "5")
    _, err = capfd.readouterr()
    assert run.code == exitcodes.USAGE_ERROR, err
    assert "Traceback" not in err and "this is a bug" not in err
    lines = [line for line in err.splitlines() if line.startswith("memdoctor: error:")]
    assert len(lines) == 1, err
    assert "could not write trace.jsonl.gz, summary.json, report.html (No space left on device)" in lines[0]
    assert "kept: 3 complete steps in" in lines[0] and "--salvage" in lines[0]
    assert not any((run.out / name).exists() for name in ("trace.jsonl.gz", "report.html", "summary.json"))
    salvaged = load_trace(run.out / "trace.jsonl.gz.partial", salvage=True)
    assert [s.step for s in salvaged.steps if s.complete] == [0, 1, 2]


# ------------------------------------------------------------------------------------- wrong verdicts

# Its own Ctrl-C handler: the loop ends at the next step and the script finishes as it would.
OWN_HANDLER = """\
stop = []
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
for step in range(3000):
    if stop:
        break
    train_step()
    if step == 3:
        open(os.path.join(os.path.dirname(os.getcwd()), "ready"), "w").close()
    time.sleep(0.01)
"""


def test_ctrl_c_to_a_script_with_its_own_handler_counts_its_steps(tmp_path: Path) -> None:
    script = make_dirs(tmp_path, fault_script(OWN_HANDLER))
    before = tree(tmp_path / "scripts")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "memdoctor", "profile", "--steps", "100000", "-o", str(out), str(script)],
        cwd=tmp_path / "cwd",
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert _wait_for(tmp_path / "ready"), "the script never reached step 4"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal: memdoctor and the script
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = Run(proc.returncode, tmp_path, out, before)
    assert run.code == exitcodes.INTERRUPTED
    steps = len(run.complete_steps())
    assert steps >= 4
    assert run.end()["status"] == "interrupted"
    assert f"after {steps} complete steps" in run.end()["message"]
    headline = run.summary["headline"]
    assert "before its first training step" not in headline and f"after {steps} complete steps" in headline


def test_a_timeout_names_the_timeout_not_ctrl_c(tmp_path: Path) -> None:
    body = "for _ in range(3):\n    train_step()\ntime.sleep(3600)\n"
    run = profile(tmp_path, fault_script(body), "--warmup", "1", "--steps", "5", "--timeout", "25")
    assert run.code == exitcodes.TIMEOUT
    stops = [e["message"] for e in run.trace.events if e.get("kind") == "interrupted"]
    assert stops == ["stopped: --timeout expired"]
    assert "Ctrl-C" not in run.end()["message"] and "Ctrl-C" not in run.summary["headline"]
    assert run.summary["headline"].startswith("The run was stopped by --timeout")
    assert run.complete_steps() == [0, 1, 2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_memdoctor_run_never_leaves_its_script_running(tmp_path: Path, signum: signal.Signals) -> None:
    """``memdoctor run`` passes SIGTERM on to the script (exit 143, as the shell reports a script killed
    by it); killed outright, its script gets SIGTERM from the kernel (Linux)."""
    script = make_dirs(tmp_path, fault_script(RUNS_ON))
    config = tmp_path / "memdoctor.yaml"
    config.write_text("memdoctor_config: 1\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memdoctor", "run", "--config", str(config), str(script)],
        cwd=tmp_path / "cwd",
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    child = None
    try:
        assert _wait_for(tmp_path / "ready"), "the script never reached step 2"
        child = int((tmp_path / "ready").read_text())
        proc.send_signal(signum)  # to memdoctor alone
        code = proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the script outlived memdoctor run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    assert code == (exitcodes.TERMINATED if signum == signal.SIGTERM else -signal.SIGKILL)
