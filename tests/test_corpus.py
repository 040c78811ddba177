"""memdoctor's closed loop on a corpus of training scripts of every common shape (issue 15, point 6).

Each script in ``tests/corpus/`` is written in the shape of a well-known public training script and knows
nothing of memdoctor. This file holds pytorch/examples' shapes (imagenet, dcgan, word_language_model,
time_sequence_prediction, regression and mnist_hogwild); ``tests/test_corpus_trainers.py`` holds the
library-style trainers (a Hugging Face ``no_trainer`` loop, a timm-style loop, a minimal GPT trainer and,
as nanoGPT is, one with globals a ``configurator.py`` overrides from ``--name=value``). For each:
``memdoctor profile``, ``plan`` under a budget below the measured peak, ``run`` of that plan, and
``profile --budget --verify`` (``corpus/harness.py``). The loop holds when no stage printed a traceback,
the profile found steps, and either the plan fits and both the run and a verified round succeed, or the
plan says that nothing fits and why.

The loops start child processes (several per script), so this file is slow: all its loops start at once
when the first test asks for them, ``WORKERS`` at a time (``corpus/pool.py``), and each test waits for its
own. Measured on 2026-12-03 on the shared 2-core machine, one loop after another: the whole corpus took
498 s of CPU with torch's default threads, 303 s with one (``tests/conftest.py``), most of a loop's in
its verify run; both files together, on 2 xdist workers: 3 min 28 s wall.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from corpus.harness import problems
from corpus.pool import LoopPool, describe

pytestmark = pytest.mark.slow

WORKERS = 2  # per file: the other half of the corpus may run beside it, on the other xdist worker
# script -> its arguments (the defaults are already tiny)
SCRIPTS: dict[str, list[str]] = {
    "imagenet_style.py": [],
    "dcgan_style.py": [],
    "word_lm_style.py": [],
    "time_seq_style.py": [],
    "regression_style.py": [],
    "hogwild_style.py": [],
}
LOOPS = LoopPool(SCRIPTS, WORKERS)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("corpus")
    LOOPS.shutdown()


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_loop_holds(name: str, corpus_dir: Path) -> None:
    LOOPS.start(corpus_dir)
    loop = LOOPS.result(name)
    found = problems(loop)
    assert found == [], f"{name}:\n  {describe(loop)}\nproblems:\n  " + "\n  ".join(found)
