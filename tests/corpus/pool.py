"""The corpus loops of one test file, started together when its first test asks for them.

A loop starts several child processes (``harness.close_the_loop``), so a file's loops run side by side,
``workers`` at a time, and each test waits for its own. The corpus is split over two test files
(``tests/test_corpus.py``: pytorch/examples' shapes; ``tests/test_corpus_trainers.py``: library-style
trainers), so that pytest-xdist's ``--dist loadfile`` gives each half to its own worker instead of one
worker holding the whole corpus for minutes.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from corpus.harness import Loop, Settings, close_the_loop, profile_cell, stage_cell

CORPUS = Path(__file__).parent


class LoopPool:
    """``scripts`` (name in this folder -> its arguments), closed on first use, ``workers`` at a time."""

    def __init__(self, scripts: dict[str, list[str]], workers: int) -> None:
        self.scripts = scripts
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._loops: dict[str, Future[Loop]] = {}

    def start(self, base: Path) -> None:
        """Submit every script's loop, once, into folders under ``base``."""
        with self._lock:
            if self._pool is not None:
                return
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="corpus")
            for name, args in self.scripts.items():
                work = base / name.removesuffix(".py")
                self._loops[name] = self._pool.submit(close_the_loop, CORPUS / name, args, work, Settings())

    def result(self, name: str) -> Loop:
        return self._loops[name].result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def describe(loop: Loop) -> str:
    """Each stage's outcome and its time, for a failing test's message."""
    cells = [f"profile: {profile_cell(loop)}"]
    cells += [f"{name}: {stage_cell(loop, name)}" for name in ("plan", "run", "verify")]
    cells += [", ".join(f"{s.name} {s.seconds:.0f} s ({s.cpu_seconds:.0f} s CPU)" for s in loop.stages)]
    return "\n  ".join(cells)
