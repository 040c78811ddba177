"""memdoctor's closed loop on the corpus's library-style trainers (issue 15, point 6).

The other half of ``tests/test_corpus.py``'s corpus, in a file of its own so that pytest-xdist's
``--dist loadfile`` runs the two halves on two workers: a Hugging Face ``no_trainer`` loop, a timm-style
loop, a minimal GPT trainer with argparse and, as nanoGPT is, one with globals a ``configurator.py``
overrides from ``--name=value``. The same loop and the same judgement as there (``corpus/harness.py``).
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
    "hf_no_trainer_style.py": [],
    "timm_style.py": [],
    "nanogpt_style.py": [],
    "gpt_configurator_style.py": [],
}
LOOPS = LoopPool(SCRIPTS, WORKERS)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("corpus_trainers")
    LOOPS.shutdown()


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_loop_holds(name: str, corpus_dir: Path) -> None:
    LOOPS.start(corpus_dir)
    loop = LOOPS.result(name)
    found = problems(loop)
    assert found == [], f"{name}:\n  {describe(loop)}\nproblems:\n  " + "\n  ".join(found)
