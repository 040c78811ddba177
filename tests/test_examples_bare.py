"""The bundled example scripts and benchmark workloads run bare (without memdoctor) and write nothing.

They are the user's code that memdoctor is tested and benchmarked on, so first of all they must work on
their own: exit 0 in a couple of steps on CPU, with no network, and leave the repository untouched (any
output directory a framework insists on goes to a temporary directory).

Each script runs from a copy of the repository's layout (``<tmp>/repo/examples/X.py``) with its working
directory elsewhere (``<tmp>/cwd``), and both must stay as they were: a script can only write into the
repository through a path relative to itself or to the working directory, and checking copies keeps the
test from failing when someone edits the real repository while it runs. Copying also proves the scripts
are standalone: they import nothing from the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120

EXAMPLES = [
    "examples/plain_loop.py",
    "examples/hf_trainer.py",
    "examples/lightning_train.py",
    "examples/accelerate_loop.py",
]
WORKLOADS = ["benchmarks/workloads/bert_story.py", "benchmarks/workloads/gpt2_trainer.py"]


def _tree(root: Path) -> set[str]:
    """Every file and directory under root, relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run_copy(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run a copy of the repository's `script` with cwd <tmp>/cwd; assert it exits 0 and writes nothing."""
    repo, cwd = tmp_path / "repo", tmp_path / "cwd"
    copy = repo / script
    copy.parent.mkdir(parents=True)
    shutil.copy2(REPO / script, copy)
    cwd.mkdir()
    before = _tree(repo)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # CPU even on a GPU machine: fast and the same everywhere
        "HF_HUB_OFFLINE": "1",  # models are built from configs; a download attempt fails loudly
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(copy), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    assert _tree(repo) == before, f"{script} wrote beside itself: {sorted(_tree(repo) - before)}"
    assert not _tree(cwd), f"{script} wrote into its working directory: {sorted(_tree(cwd))}"
    return proc


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_bare(script: str, tmp_path: Path) -> None:
    _run_copy(script, ["--steps", "2"], tmp_path)


@pytest.mark.parametrize("script", WORKLOADS)
def test_workload_runs_tiny_and_times_every_step(script: str, tmp_path: Path) -> None:
    timing = tmp_path / "steps.jsonl"
    _run_copy(script, ["--tiny", "--steps", "2", "--timing-file", str(timing)], tmp_path)
    records = [json.loads(line) for line in timing.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["step_ms"] > 0 for r in records)
