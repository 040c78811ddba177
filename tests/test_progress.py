"""The progress bar's polling logic: counting step records in a partial trace as the child writes it."""

from __future__ import annotations

import gzip
import io
import sys
import threading
import time
from pathlib import Path

import pytest

from memdoctor.launch import progress
from memdoctor.launch.progress import Counts, ProgressFollower, StepCounter
from memdoctor.trace import TraceWriter, make_header


def _step(n: int, warmup: bool = False) -> dict[str, object]:
    return {"type": "step", "step": n, "warmup": warmup, "note": '"type":"step" inside a string'}


def test_counter_counts_steps_as_they_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl.gz.partial"
    counter = StepCounter(path)
    assert not counter.poll()  # no file yet: the child is still starting
    writer = TraceWriter(path)
    writer.write(make_header())
    writer.write({"type": "model", "name": "x"})
    assert not counter.poll() and counter.counts == Counts(0, 0)
    writer.write(_step(0, warmup=True))
    assert counter.poll() and counter.counts == Counts(warmup=1, profiled=0)
    writer.write(_step(1))
    writer.write(_step(2))
    assert counter.poll() and counter.counts == Counts(warmup=1, profiled=2)
    assert not counter.poll()  # nothing new: nothing read, nothing counted twice
    writer.close()


def test_counter_rereads_a_member_cut_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    whole = gzip.compress(b'{"step":1,"type":"step","warmup":false}\n', mtime=0)
    path.write_bytes(whole[:-5])  # the child has written most of the member
    counter = StepCounter(path)
    assert not counter.poll() and counter.counts.profiled == 0
    path.write_bytes(whole + whole)
    assert counter.poll() and counter.counts.profiled == 2


def test_counter_skips_bytes_that_are_not_gzip(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    path.write_bytes(b"not a trace at all")
    counter = StepCounter(path)
    assert not counter.poll()
    with path.open("ab") as fh:
        fh.write(gzip.compress(b'{"type":"step","warmup":false}\n'))
    assert counter.poll() and counter.counts.profiled == 1  # it moved past the junk, not stuck on it


def test_follower_thread_reports_and_is_joined(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    seen: list[int] = []
    writer = TraceWriter(path)
    with ProgressFollower(path, lambda c: seen.append(c.profiled), interval_s=0.01) as follower:
        assert follower._thread.name == "memdoctor-progress" and follower._thread.is_alive()
        writer.write(_step(1))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.write(_step(2))
    writer.close()
    assert seen[0] == 1 and seen[-1] == 2  # the last poll on exit reports the final count
    assert not any(t.name == "memdoctor-progress" for t in threading.enumerate())


def test_follower_survives_a_failing_callback(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    TraceWriter(path).write(_step(1))

    def boom(counts: Counts) -> None:
        raise RuntimeError("terminal went away")

    with ProgressFollower(path, boom, interval_s=0.01):
        time.sleep(0.05)  # the thread's exception must not escape or hang the join


def test_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert progress.wanted() is False
    monkeypatch.setattr(sys, "stdout", Tty())
    assert progress.wanted() is True


def test_terminal_bar_describes_warmup_then_steps() -> None:
    bar = progress.TerminalBar(warmup=2, steps=5)
    bar.update(Counts(warmup=1, profiled=0))
    task = bar._progress.tasks[0]
    assert task.description == "warm-up 1/2" and task.completed == 0
    bar.update(Counts(warmup=2, profiled=3))
    assert bar._progress.tasks[0].description == "step" and bar._progress.tasks[0].completed == 3
