"""memdoctor's closed loop on a corpus of training scripts of every common shape (issue 15, point 6).

Each script in ``tests/corpus/`` is written in the shape of a well-known public training script
(pytorch/examples' imagenet, dcgan, word_language_model, time_sequence_prediction, regression and
mnist_hogwild; a Hugging Face ``no_trainer`` loop; a timm-style loop; a minimal GPT trainer, with
argparse and, as nanoGPT is, with globals a ``configurator.py`` overrides from ``--name=value``) and knows
nothing of memdoctor. For each: ``memdoctor profile``, ``plan`` under a budget below the measured peak,
``run`` of that plan, and ``profile --budget --verify`` (``corpus/harness.py``). The loop holds when no
stage printed a traceback, the profile found steps, and either the plan fits and both the run and a
verified round succeed, or the plan says that nothing fits and why.

The loops start child processes (several per script), so this file is slow: all loops start at once
when the first test asks for them, ``WORKERS`` at a time, and each test waits for its own. Measured on
2026-12-03 (7 of the 9 loops stopping early): 6 min 19 s of CPU in all, 8 min wall on the shared
2-core machine; a loop that goes through every stage takes 50-95 s of CPU, most of it the verify run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from corpus.harness import Loop, Settings, close_the_loop, problems, profile_cell, stage_cell

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parent / "corpus"
WORKERS = 3
# script -> its arguments (the defaults are already tiny)
SCRIPTS: dict[str, list[str]] = {
    "imagenet_style.py": [],
    "dcgan_style.py": [],
    "word_lm_style.py": [],
    "time_seq_style.py": [],
    "regression_style.py": [],
    "hogwild_style.py": [],
    "hf_no_trainer_style.py": [],
    "timm_style.py": [],
    "nanogpt_style.py": [],
    "gpt_configurator_style.py": [],
}

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_loops: dict[str, Future[Loop]] = {}


def _start_all(base: Path) -> None:
    global _pool
    with _lock:
        if _pool is not None:
            return
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="corpus")
        for name, args in SCRIPTS.items():
            work = base / name.removesuffix(".py")
            _loops[name] = _pool.submit(close_the_loop, CORPUS / name, args, work, Settings())


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("corpus")
    if _pool is not None:
        _pool.shutdown(wait=True)


def _describe(loop: Loop) -> str:
    cells = [f"profile: {profile_cell(loop)}"]
    cells += [f"{name}: {stage_cell(loop, name)}" for name in ("plan", "run", "verify")]
    cells += [", ".join(f"{s.name} {s.seconds:.0f} s ({s.cpu_seconds:.0f} s CPU)" for s in loop.stages)]
    return "\n  ".join(cells)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_loop_holds(name: str, corpus_dir: Path) -> None:
    _start_all(corpus_dir)
    loop = _loops[name].result()
    found = problems(loop)
    assert found == [], f"{name}:\n  {_describe(loop)}\nproblems:\n  " + "\n  ".join(found)
