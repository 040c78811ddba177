"""One run, one folder; a failed write never raises into the script; every stop says its cause.

In-process and quick: the folder claim (``memdoctor.outputs.FolderClaim``), the trace writer's
``on_error``, saving outputs on a full disk (``memdoctor.launch.saving``), and the verdicts of runs
stopped by a signal, ``--timeout`` or a failed write (``supervisor.classify``, the headline). The same
cases end to end, with real children and signals: ``tests/test_faults_stops.py``.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tracebuilder import TraceBuilder, tiny_mlp

from memdoctor import exitcodes
from memdoctor.analysis.headline import fault_sentence
from memdoctor.errors import OutputError, UsageError
from memdoctor.launch import saving
from memdoctor.launch.childrun import ChildOutcome
from memdoctor.launch.supervisor import classify
from memdoctor.outputs import LOCK_NAME, FolderClaim, FolderHeld, profile_output_dir
from memdoctor.trace import TraceWriter, load_trace

# ----------------------------------------------------------------------------------------- the claim


def test_an_explicit_folder_held_by_a_run_is_refused_naming_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = profile_output_dir(out, force=False)
    try:
        with pytest.raises(UsageError) as err:
            profile_output_dir(out, force=True)  # --force overwrites files, never a live run's
        message = str(err.value)
        assert f"in use by memdoctor profile (pid {os.getpid()}" in message and "started " in message
        assert "\n" not in message
    finally:
        first.release()
    assert not (out / LOCK_NAME).exists()  # released: nothing of the claim is left behind


def test_the_default_folder_held_by_a_run_moves_to_the_next(tmp_path: Path) -> None:
    first = profile_output_dir(None, force=False, cwd=tmp_path)
    second = profile_output_dir(None, force=False, cwd=tmp_path)
    try:
        assert first.path == tmp_path / "memdoctor-report"
        assert second.path == tmp_path / "memdoctor-report-1"
        assert second.note is not None and "in use by another memdoctor run" in second.note
    finally:
        first.release()
        second.release()


def test_a_claim_is_exclusive_and_free_again_once_released(tmp_path: Path) -> None:
    claim = FolderClaim(tmp_path)
    with pytest.raises(FolderHeld) as held:
        FolderClaim(tmp_path)
    assert held.value.holder["pid"] == os.getpid()
    claim.release()
    with FolderClaim(tmp_path):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_file_of_a_run_that_died_is_no_claim(tmp_path: Path) -> None:
    # memdoctor killed with SIGKILL leaves its lock file; the kernel released the lock itself
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 999999999, "host": "gone", "started_unix": 0}')
    claimed = profile_output_dir(out, force=False)
    try:
        assert claimed.path == out
    finally:
        claimed.release()


# ----------------------------------------------------------------------------------------- writing


def _failing_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The n+1-th record onward: half of it reaches the file, then the disk is full."""
    original = TraceWriter._append
    count = [0]

    def append(self: TraceWriter, member: bytes) -> None:
        count[0] += 1
        if count[0] > n:
            assert self._fh is not None
            self._fh.write(member[: len(member) // 2])
            self._fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, member)

    monkeypatch.setattr(TraceWriter, "_append", append)


def test_a_failed_write_goes_to_on_error_once_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = TraceBuilder(kind="cpu", budget_bytes=None)
    trace.add_model(tiny_mlp(width=8, depth=2))
    records = list(trace.add_steps(warmup=1, profiled=3).build().records())
    _failing_after(monkeypatch, 3)  # header, model, step 0
    errors: list[OSError] = []
    writer = TraceWriter(tmp_path / "t.partial", on_error=errors.append)
    for rec in records:
        writer.write(rec)  # never raises
    writer.close()
    assert [e.errno for e in errors] == [errno.ENOSPC]
    assert writer.records_written == 3
    salvaged = load_trace(tmp_path / "t.partial", salvage=True)  # the half record is left out
    assert len(salvaged.models) == 1 and len(salvaged.steps) == 1 and salvaged.truncated


def test_without_on_error_a_failed_write_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_after(monkeypatch, 0)
    writer = TraceWriter(tmp_path / "t.partial")
    with pytest.raises(OSError):
        writer.write({"type": "event"})


def _small_trace() -> Any:
    b = TraceBuilder(kind="cpu", budget_bytes=None)
    b.add_model(tiny_mlp(width=8, depth=2))
    return b.add_steps(warmup=1, profiled=2).end("completed").build()


def test_a_full_disk_when_saving_the_trace_keeps_the_partial_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    partial = tmp_path / "trace.jsonl.gz.partial"
    partial.write_bytes(b"whatever the child flushed")

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "save_trace", full)
    saved = saving.save_outputs(_small_trace(), tmp_path, partial)
    assert saved.paths == {} and saved.kept == partial and partial.exists()
    line = saving.failure_line(saved, 3)
    assert line is not None and "\n" not in line
    assert "could not write trace.jsonl.gz, summary.json, report.html (No space left on device)" in line
    assert "kept: 3 complete steps in" in line and "memdoctor report --salvage" in line


@pytest.mark.slow  # renders a report (a few seconds on a busy machine)
def test_a_full_disk_at_the_report_names_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memdoctor.report import render

    real = render.atomic_write

    def full_for_the_report(path: Path, text: str) -> None:
        if path.name == "report.html":
            raise OutputError(f"cannot write {path}: No space left on device")
        real(path, text)

    monkeypatch.setattr(render, "atomic_write", full_for_the_report)
    partial = tmp_path / "trace.jsonl.gz.partial"
    partial.write_bytes(b"")
    saved = saving.save_outputs(_small_trace(), tmp_path, partial)
    assert set(saved.paths) == {"trace", "summary"} and not partial.exists()
    assert [p.name for p, _ in saved.failed] == ["report.html"]
    line = saving.failure_line(saved, 2) or ""
    assert line.startswith("could not write report.html (")
    assert "written: trace.jsonl.gz, summary.json" in line


# ----------------------------------------------------------------------------------------- verdicts


def test_a_signal_to_memdoctor_is_a_stop_with_the_conventional_code() -> None:
    trace = _small_trace()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        status, code, message = classify(trace, ChildOutcome(returncode=130, stop_signal=signum))
        assert (status, code) == ("stopped", 128 + signum)
        assert f"memdoctor received {signal.Signals(signum).name} after 3 complete steps" in message


def test_a_failed_write_and_a_timeout_name_their_cause() -> None:
    trace = _small_trace()
    failed = ChildOutcome(returncode=75, write_failed={"reason": "No space left on device"})
    status, code, message = classify(trace, failed)
    assert (status, code) == ("output_failed", exitcodes.USAGE_ERROR)
    assert "No space left on device" in message and "Ctrl-C" not in message
    status, code, message = classify(trace, ChildOutcome(returncode=130, timed_out=True))
    assert (status, code) == ("timeout", exitcodes.TIMEOUT) and "Ctrl-C" not in message


def test_an_interrupt_after_some_steps_is_never_before_the_first_step() -> None:
    # a script with its own SIGINT handler ends its loop and finishes: no step was left unfinished
    summary = {"steps": [{"complete": True}] * 44, "device": {"kind": "cpu"}}
    fault = {"kind": "interrupted", "step": None}
    text = fault_sentence(summary, fault)
    assert "after 44 complete steps" in text and "before its first" not in text
    assert "before its first training step" in fault_sentence({"steps": [], "device": {}}, fault)
    timeout = fault_sentence(summary, {"kind": "timeout", "step": None, "message": "x"})
    assert timeout.startswith("The run was stopped by --timeout")
    stopped = {"kind": "stopped", "step": None, "message": "stopped: memdoctor received SIGHUP"}
    assert fault_sentence(summary, stopped).startswith("The run was stopped by SIGHUP sent to memdoctor")


@pytest.mark.slow  # renders a report
def test_memdoctor_report_on_a_full_disk_names_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from memdoctor.cli import main
    from memdoctor.report import render
    from memdoctor.trace import save_trace

    trace_path = save_trace(_small_trace(), tmp_path / "trace.jsonl.gz")
    real = render.atomic_write

    def full_for_the_report(path: Path, text: str) -> None:
        if path.name == "report.html":
            raise OutputError(f"cannot write {path}: No space left on device")
        real(path, text)

    monkeypatch.setattr(render, "atomic_write", full_for_the_report)
    code = main(["report", str(trace_path), "-o", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert code == exitcodes.USAGE_ERROR
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "could not write report.html (No space left on device)" in lines[0]
    assert "written: summary.json" in lines[0] and "kept: 3 complete steps in" in lines[0]
