"""The bundled example scripts and benchmark workloads run bare (without memdoctor) and write nothing.

They are the user's code that memdoctor is tested and benchmarked on, so first of all they must work on
their own: exit 0 in a couple of steps on CPU, with no network, and leave the repository untouched (any
output directory a framework insists on goes to a temporary directory).

Each script runs from a copy of the repository's layout (``<tmp>/repo/examples/X.py``) with its working
directory elsewhere (``<tmp>/cwd``), and both must stay as they were: a script can only write into the
repository through a path relative to itself or to the working directory, and checking copies keeps the
test from failing when someone edits the real repository while it runs. Copying also proves the scripts
are standalone: they import nothing from the repository (a workload may import its sibling workloads,
``WORKLOAD_SHARED``, which are copied beside it).

Importing torch and transformers dominates each run, so all selected scripts start at once (one thread each)
when the module's first test asks for them; each test then waits for its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# A guard against a hang, not a speed target: the seven scripts start at once on CI's 2 cores, and under
# pytest-xdist the other worker's tests run beside them (plain_loop took 42 s alone, over 120 s beside
# the corpus in CI, its two steps done)
TIMEOUT_S = 300

EXAMPLES = [
    "examples/plain_loop.py",
    "examples/hf_trainer.py",
    "examples/lightning_train.py",
    "examples/accelerate_loop.py",
]
WORKLOADS = [
    "benchmarks/workloads/bert_story.py",
    "benchmarks/workloads/gpt2_trainer.py",
    "benchmarks/workloads/vit_lightning.py",
]
WORKLOAD_SHARED = ["benchmarks/workloads/bert_story.py", "benchmarks/workloads/vit_train.py"]
TIMING_FILE = "steps.jsonl"


@dataclass
class Run:
    script: str
    repo: Path  # a copy of the repository layout holding only the script
    cwd: Path
    timing: Path
    before: set[str]
    proc: subprocess.Popen[str]


def _tree(root: Path) -> set[str]:
    """Every file and directory under root, relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _start(script: str, args: list[str], base: Path) -> Run:
    repo, cwd = base / "repo", base / "cwd"
    copy = repo / script
    copy.parent.mkdir(parents=True)
    for shared in WORKLOAD_SHARED if script in WORKLOADS else []:
        shutil.copy2(REPO / shared, repo / shared)
    shutil.copy2(REPO / script, copy)
    cwd.mkdir()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # CPU even on a GPU machine: fast and the same everywhere
        "HF_HUB_OFFLINE": "1",  # models are built from configs; a download attempt fails loudly
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",  # the scripts run side by side
    }
    before = _tree(repo)
    proc = subprocess.Popen(
        [sys.executable, str(copy), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Run(script, repo, cwd, base / TIMING_FILE, before, proc)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Run]]:
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    started: dict[str, Run] = {}
    try:
        for script in (s for s in EXAMPLES if s in selected):
            started[script] = _start(script, ["--steps", "2"], tmp_path_factory.mktemp("example"))
        for script in (s for s in WORKLOADS if s in selected):
            base = tmp_path_factory.mktemp("workload")
            args = ["--tiny", "--steps", "2", "--timing-file", str(base / TIMING_FILE)]
            started[script] = _start(script, args, base)
        yield started
    finally:
        for run in started.values():
            if run.proc.poll() is None:
                run.proc.kill()
            run.proc.communicate()


def _finish(run: Run) -> None:
    """Wait for the run; assert it exited 0 and wrote nothing beside itself or into its cwd."""
    try:
        stdout, stderr = run.proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        stdout, stderr = run.proc.communicate()
        pytest.fail(f"{run.script} ran past {TIMEOUT_S} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    assert run.proc.returncode == 0, f"exit {run.proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert _tree(run.repo) == run.before, f"{run.script} wrote beside itself: {_tree(run.repo) - run.before}"
    assert not _tree(run.cwd), f"{run.script} wrote into its working directory: {sorted(_tree(run.cwd))}"


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_bare(script: str, runs: dict[str, Run]) -> None:
    _finish(runs[script])


@pytest.mark.parametrize("script", WORKLOADS)
def test_workload_runs_tiny_and_times_every_step(script: str, runs: dict[str, Run]) -> None:
    run = runs[script]
    _finish(run)
    records = [json.loads(line) for line in run.timing.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["step_ms"] > 0 for r in records)
