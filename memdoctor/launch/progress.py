"""The terminal progress bar of ``memdoctor profile``: "step k/N", followed from the partial trace.

The child already appends one gzip member per record to ``trace.jsonl.gz.partial`` and flushes it as
each step finishes, so the supervising parent can follow that file with no new protocol: a thread
named ``memdoctor-progress`` looks at the file's size every half second and, only when it grew, reads
the new bytes and counts the step records in them. The rendering (rich) is a thin callback; the
polling logic (``StepCounter``) is plain code, tested without a terminal.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

POLL_S = 0.5
THREAD_NAME = "memdoctor-progress"


@dataclass
class Counts:
    """What the child has recorded so far."""

    warmup: int = 0  # warm-up steps finished
    profiled: int = 0  # profiled steps finished


class StepCounter:
    """Counts the step records of a growing trace file, reading each byte once.

    A record is one gzip member (``TraceWriter``); a member cut short by the poll (the child is still
    writing it) is read again, whole, at the next poll.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.counts = Counts()
        self._offset = 0

    def poll(self) -> bool:
        """Read what the file gained since the last poll; True when a step record was added."""
        try:
            size = self.path.stat().st_size
        except OSError:  # not created yet (the child is importing torch), or already renamed
            return False
        if size <= self._offset:
            return False
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read(size - self._offset)
        except OSError:
            return False
        before = (self.counts.warmup, self.counts.profiled)
        self._offset += self._consume(data)
        return (self.counts.warmup, self.counts.profiled) != before

    def _consume(self, data: bytes) -> int:
        """Count the whole members at the start of ``data``; return how many bytes they took."""
        pos = 0
        while pos < len(data):
            d = zlib.decompressobj(wbits=31)
            try:
                chunk = d.decompress(data[pos:])
            except zlib.error:
                return len(data)  # not a trace we can follow: skip it rather than re-read it forever
            if not d.eof:
                return pos  # the child is mid-write: this member again next time
            self._count(chunk)
            pos = len(data) - len(d.unused_data)
        return pos

    def _count(self, chunk: bytes) -> None:
        for line in chunk.splitlines():
            # The header and model records come first and are not steps; a cheap test before parsing.
            if b'"type":"step"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("type") == "step":
                if rec.get("warmup"):
                    self.counts.warmup += 1
                else:
                    self.counts.profiled += 1


class ProgressFollower:
    """A context manager: a ``memdoctor-progress`` thread polls ``StepCounter`` and calls ``on_change``.

    The thread is joined on exit, and a last poll runs then so the final count is reported.
    """

    def __init__(self, path: Path, on_change: Callable[[Counts], None], interval_s: float = POLL_S) -> None:
        self.counter = StepCounter(path)
        self._on_change = on_change
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def __enter__(self) -> ProgressFollower:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self._interval)
            try:
                if self.counter.poll():
                    self._on_change(self.counter.counts)
            except Exception:  # a progress bar must never break the profile it shows
                return
            if stopping:
                return


class TerminalBar:
    """rich's progress bar, "warm-up k/W" then "step k/N"; only when stdout is a terminal."""

    def __init__(self, warmup: int, steps: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.warmup, self.steps = warmup, steps
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,  # gone once done: the summary table follows
        )
        self._task = self._progress.add_task("starting the script", total=max(steps, 1), completed=0)

    def __enter__(self) -> TerminalBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(OSError):  # the terminal is gone (a SIGHUP): the outputs still follow
            self._progress.stop()

    def update(self, counts: Counts) -> None:
        if counts.profiled == 0 and self.warmup:
            desc = f"warm-up {min(counts.warmup, self.warmup)}/{self.warmup}"
        else:
            desc = "step"  # followed by the "k/N" column: "step 3/5"
        self._progress.update(self._task, description=desc, completed=min(counts.profiled, self.steps))


def wanted() -> bool:
    """A bar only on an interactive terminal: never in logs, pipes or CI output."""
    return sys.stdout.isatty()
