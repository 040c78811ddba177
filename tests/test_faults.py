"""Bad input and dying scripts, for real: each case profiles a tiny fault script in a supervised child.

Every script is a small ``nn.Linear`` + SGD loop written into ``<tmp>/scripts`` (its folder), run from an
empty ``<tmp>/cwd`` with its outputs in ``<tmp>/out``: each case checks the exit code, what the trace,
report and summary say, that the measured steps are kept, and that memdoctor wrote nothing beside the
script or into the working folder. Runs go through ``memdoctor.cli.main`` in-process, except Ctrl-C,
which is sent to a ``python -m memdoctor`` process group as a terminal would.

Runs that several tests read are made once (``runs`` caches them).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from memdoctor import exitcodes
from memdoctor.cli import main
from memdoctor.trace import Trace, load_trace

pytestmark = pytest.mark.slow

CHILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
OUTPUT_FILES = ("trace.jsonl.gz", "report.html", "summary.json")

# A GAN-style loop: the discriminator (SGD with momentum) steps, then the generator's forward and backward
# run, then the generator (Adam) steps; one training step, two optimizers.
GAN = """\
import torch
from torch import nn

torch.manual_seed(0)
g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
opt_d = torch.optim.SGD(d.parameters(), lr=1e-3, momentum=0.9)
for _ in range(20):
    fake = g(torch.randn(16, 4))
    loss_d = d(torch.randn(16, 4)).mean() - d(fake.detach()).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    loss_g = -d(fake).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
"""

# A DataLoader with two worker processes and a slow dataset: the loop waits for its batches.
WORKERS = """\
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.randn(8), torch.randn(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(Slow(), batch_size=4, num_workers=2):
        (model(x) - y).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
"""

# A tiny model whose middle module can be told to raise on its n-th forward call (FAIL_AT).
PRELUDE = """\
import os
import re
import signal
import sys
import time

import torch
from torch import nn


class Flaky(nn.Module):
    def __init__(self, fail_at):
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        if self.calls == self.fail_at:
            raise FAIL_WITH(f"flaky forward failed on call {self.calls}")
        self.calls += 1
        return torch.relu(x)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), Flaky(FAIL_AT), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)


def train_step():
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


"""


def fault_script(body: str, *, fail_at: int = -1, before: str = "", error: str = "ValueError") -> str:
    """The prelude's model, whose ``Flaky`` module raises ``error`` on its ``fail_at``-th forward."""
    return before + f"FAIL_AT = {fail_at}\n" + PRELUDE + f"FAIL_WITH = {error}\n\n" + body


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@dataclass
class Run:
    code: int
    base: Path
    out: Path
    scripts_before: set[str]

    @property
    def trace(self) -> Trace:
        return load_trace(self.out / "trace.jsonl.gz")

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    def complete_steps(self) -> list[int]:
        return [s.step for s in self.trace.steps if s.complete]

    def end(self) -> dict[str, Any]:
        end = self.trace.end
        assert end is not None, "the trace has no end record"
        return end

    def assert_outputs(self) -> None:
        for name in OUTPUT_FILES:
            assert (self.out / name).stat().st_size > 0, f"{name} missing or empty"

    def assert_clean(self) -> None:
        """memdoctor wrote nothing beside the script (the scripts write nothing) nor into the cwd."""
        assert tree(self.base / "scripts") == self.scripts_before, "memdoctor wrote beside the script"
        assert not tree(self.base / "cwd"), f"memdoctor wrote into the cwd: {sorted(tree(self.base / 'cwd'))}"


def make_dirs(base: Path, source: str | None) -> Path:
    """``base/scripts/train.py`` holding ``source`` (none when None), and an empty ``base/cwd``."""
    (base / "scripts").mkdir(parents=True)
    (base / "cwd").mkdir()
    script = base / "scripts" / "train.py"
    if source is not None:
        script.write_text(source)
    return script


def profile(
    base: Path,
    source: str | None,
    *options: str,
    out: Path | None = None,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Run:
    """``memdoctor profile OPTIONS -o OUT base/scripts/train.py -- ARGS``, in-process, from ``base/cwd``."""
    script = make_dirs(base, source) if not (base / "scripts").exists() else base / "scripts" / "train.py"
    out = out or base / "out"
    before = tree(base / "scripts")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base / "cwd")
        for key, value in {**CHILD_ENV, **(env or {})}.items():
            mp.setenv(key, value)
        code = main(["profile", *options, "-o", str(out), str(script), "--", *args])
    return Run(code, base, out, before)


# ----------------------------------------------------------------------------------------- the cases

STEPS = ("--warmup", "1", "--steps", "5")  # more than the scripts run: they end (or die) first

CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "raise_at_import": (
        fault_script("train_step()\n", before="import torch\nimport memdoctor_test_no_such_module\n"),
        STEPS,
    ),
    "raise_at_step_0": (fault_script("for _ in range(8):\n    train_step()\n", fail_at=0), STEPS),
    "raise_at_step_2": (fault_script("for _ in range(8):\n    train_step()\n", fail_at=2), STEPS),
    "exit_0_after_3": (fault_script("for _ in range(3):\n    train_step()\nsys.exit(0)\n"), STEPS),
    "exit_3_after_1": (fault_script("train_step()\nsys.exit(3)\n"), STEPS),
    # forwards only: no backward, so no training step (a backward without an optimizer is a step found
    # from backward passes: tests/test_steps_found.py)
    "no_training_step": (
        fault_script("with torch.no_grad():\n    for _ in range(3):\n        model(x).sum()\n"),
        STEPS,
    ),
    "ends_after_2": (fault_script("for _ in range(2):\n    train_step()\n"), STEPS),
    "os_exit_after_2": (fault_script("for _ in range(2):\n    train_step()\nos._exit(7)\n"), STEPS),
    "segfault_after_2": (
        fault_script("for _ in range(2):\n    train_step()\nimport ctypes\nctypes.string_at(0)\n"),
        STEPS,
    ),
    "sigkill_after_2": (
        fault_script("for _ in range(2):\n    train_step()\nos.kill(os.getpid(), signal.SIGKILL)\n"),
        STEPS,
    ),
    "raise_at_step_3": (fault_script("for _ in range(8):\n    train_step()\n", fail_at=3), STEPS),
    "oom_at_step_0": (
        fault_script("for _ in range(8):\n    train_step()\n", fail_at=0, error="MemoryError"),
        STEPS,
    ),
    "oom_at_step_3": (
        fault_script("for _ in range(8):\n    train_step()\n", fail_at=3, error="torch.OutOfMemoryError"),
        STEPS,
    ),
    "nan_loss": (
        fault_script(
            "for i in range(8):\n    if i == 2:\n        x[0, 0] = float('nan')\n    train_step()\n"
        ),
        STEPS,
    ),
    "two_optimizers": (GAN, ("--warmup", "1", "--steps", "3")),
    "dataloader_workers": (WORKERS, ("--warmup", "1", "--steps", "3")),
}

# Planted secrets: in the environment and on the script's command line of the raise_at_step_3 run.
SECRET_ENV = {"HF_TOKEN": "hf_memdoctorPlantedEnvSecret", "WANDB_API_KEY": "memdoctorPlantedWandbKey"}
SECRET_ARG = "memdoctorPlantedArgSecret"
ALLOWED_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CASE_EXTRAS: dict[str, dict[str, Any]] = {
    "raise_at_step_3": {
        "env": {**SECRET_ENV, **ALLOWED_ENV},
        "args": ("--token", SECRET_ARG, f"--api-key={SECRET_ARG}", "--lr", "0.1"),
    },
}


class Runs:
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[str, Run] = {}

    def __getitem__(self, case: str) -> Run:
        if case not in self.done:
            source, options = CASES[case]
            extras = CASE_EXTRAS.get(case, {})
            self.done[case] = profile(self.factory.mktemp(case), source, *options, **extras)
        return self.done[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


# ----------------------------------------------------------------------------------------- bad input


def test_missing_script_is_one_line_and_creates_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    make_dirs(tmp_path, None)
    run = profile(tmp_path, None)
    assert run.code == exitcodes.USAGE_ERROR
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "train.py" in err and "Traceback" not in err
    assert not run.out.exists()
    run.assert_clean()
    # without -o: no default memdoctor-report folder appears in the cwd either
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path / "cwd")
        assert main(["profile", "train.py"]) == exitcodes.USAGE_ERROR
    assert "Traceback" not in capfd.readouterr().err
    run.assert_clean()


def test_existing_output_folder_is_refused_without_force(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes")
    run = profile(tmp_path, fault_script("for _ in range(5):\n    train_step()\n"), "--steps", "2", out=out)
    assert run.code == exitcodes.USAGE_ERROR
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--force" in err and "Traceback" not in err
    assert tree(out) == {"notes.txt"} and (out / "notes.txt").read_text() == "the user's notes"
    run.assert_clean()


def test_force_writes_into_the_folder_and_keeps_the_users_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes")
    (out / "summary.json").write_text("{}")  # memdoctor's own file: --force may overwrite it
    source = fault_script("for _ in range(5):\n    train_step()\n")
    run = profile(tmp_path, source, "--force", "--warmup", "1", "--steps", "2", out=out)
    assert run.code == exitcodes.OK
    assert (out / "notes.txt").read_text() == "the user's notes"
    run.assert_outputs()
    assert run.summary["steps_profiled"] == 2
    assert tree(out) <= {"notes.txt", *OUTPUT_FILES}
    run.assert_clean()


# ----------------------------------------------------------------------------------------- exceptions


def test_raise_at_import(runs: Runs) -> None:
    run = runs["raise_at_import"]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    end = run.end()
    assert end["status"] == "exception"
    assert "ModuleNotFoundError" in end["message"] and "memdoctor_test_no_such_module" in end["message"]
    assert run.complete_steps() == []
    assert run.summary["fault"]["exception_type"].endswith("ModuleNotFoundError")
    run.assert_clean()


def test_raise_in_forward_at_step_0_keeps_the_partial_step(runs: Runs) -> None:
    run = runs["raise_at_step_0"]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    trace = run.trace
    assert [(s.step, s.complete) for s in trace.steps] == [(0, False)]
    assert len(trace.steps[0].timeline["t_ms"] or []) >= 2, "the dying step kept no samples"
    event = trace.events[-1]
    assert event["kind"] == "exception" and "flaky forward failed" in event["message"]
    assert event["step"] == 0 and event["phase"] == "forward"
    assert run.end()["status"] == "exception" and run.end()["steps_recorded"] == 0
    run.assert_clean()


def test_raise_in_forward_at_step_0_names_the_module(runs: Runs) -> None:
    trace = runs["raise_at_step_0"].trace
    assert [m.names for m in trace.models] == [["", "0", "1", "2"]]
    assert trace.events[-1]["module_name"] == "1"
    assert trace.steps[0].modules, "no per-module columns for the step that died"


def test_raise_in_forward_at_step_2(runs: Runs) -> None:
    run = runs["raise_at_step_2"]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    trace = run.trace
    assert [(s.step, s.complete) for s in trace.steps] == [(0, True), (1, True), (2, False)]
    event = trace.events[-1]
    assert event["kind"] == "exception"
    assert (event["step"], event["phase"], event["module_name"]) == (2, "forward", "1")
    end = run.end()
    assert end["status"] == "exception" and end["steps_recorded"] == 2 and "step 2" in end["message"]
    assert run.summary["fault"]["module_name"] == "1"
    run.assert_clean()


# ----------------------------------------------------------------------------------------- ending early


def test_sys_exit_0_after_3_steps(runs: Runs) -> None:
    run = runs["exit_0_after_3"]
    assert run.code == exitcodes.OK
    run.assert_outputs()
    assert run.end()["status"] == "script_exit" and run.end()["exit_code"] == 0
    assert run.complete_steps() == [0, 1, 2]
    run.assert_clean()


def test_sys_exit_3_fails(runs: Runs) -> None:
    run = runs["exit_3_after_1"]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    end = run.end()
    assert end["status"] == "script_exit" and end["exit_code"] == 3 and "sys.exit(3)" in end["message"]
    assert run.complete_steps() == [0]
    run.assert_clean()


def test_no_training_step(runs: Runs) -> None:
    run = runs["no_training_step"]
    assert run.code == exitcodes.NO_STEPS
    run.assert_outputs()
    assert run.end()["status"] == "no_steps"
    assert run.complete_steps() == []
    assert run.summary["steps_profiled"] == 0 and run.summary["peak_memory_bytes"] is None
    run.assert_clean()


def test_script_ending_before_the_requested_steps(runs: Runs) -> None:
    run = runs["ends_after_2"]
    assert run.code == exitcodes.OK
    run.assert_outputs()
    assert run.end()["status"] == "script_finished"
    assert run.complete_steps() == [0, 1]
    assert run.summary["steps_profiled"] == 1  # step 0 is the warm-up
    run.assert_clean()


# ----------------------------------------------------------------------------------------- hard deaths

HARD = {
    "os_exit_after_2": ("crashed", None, 7),
    "segfault_after_2": ("crashed", "SIGSEGV", None),
    "sigkill_after_2": ("killed", "SIGKILL", None),
}


@pytest.mark.parametrize("case", list(HARD))
def test_hard_death_is_reported(runs: Runs, case: str) -> None:
    run = runs[case]
    status, signal_name, exit_code = HARD[case]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    end = run.end()
    assert (end["status"], end["signal"], end["exit_code"]) == (status, signal_name, exit_code)
    assert run.complete_steps()[:1] == [0], "the first finished step was lost"
    assert run.summary["fault"]["kind"] == status
    run.assert_clean()


@pytest.mark.parametrize("case", list(HARD))
def test_hard_death_keeps_every_finished_step(runs: Runs, case: str) -> None:
    assert runs[case].complete_steps() == [0, 1]


# ----------------------------------------------------------------------------------------- signals


def _read_lines(stream: Any, lines: list[str], ready: threading.Event) -> None:
    for line in stream:
        lines.append(line)
        if line.strip() == "READY":
            ready.set()


def test_ctrl_c_keeps_the_steps_and_exits_130(tmp_path: Path) -> None:
    body = (
        "step = 0\nwhile True:\n    train_step()\n    step += 1\n"
        "    if step == 2:\n        print('READY', flush=True)\n    time.sleep(0.02)\n"
    )
    script = make_dirs(tmp_path, fault_script(body))
    before = tree(tmp_path / "scripts")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--warmup", "1", "--steps", "100000", "-o", str(out)]
    proc = subprocess.Popen(
        [*cmd, str(script)],
        cwd=tmp_path / "cwd",
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: list[str] = []
    errs: list[str] = []  # drained as it comes, so a chatty child can never block on a full pipe
    ready = threading.Event()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines, ready), daemon=True)
    err_reader = threading.Thread(
        target=_read_lines, args=(proc.stderr, errs, threading.Event()), daemon=True
    )
    reader.start()
    err_reader.start()
    try:
        assert ready.wait(90), f"the script never printed READY: {''.join(lines)}"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"no exit 60 s after Ctrl-C; stdout: {''.join(lines)[-2000:]} stderr: {''.join(errs)[-2000:]}"
            )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    err_reader.join(10)
    err = "".join(errs)
    assert proc.returncode == exitcodes.INTERRUPTED, err
    assert "Traceback" not in err, err
    run = Run(proc.returncode, tmp_path, out, before)
    run.assert_outputs()
    assert run.end()["status"] == "interrupted"
    assert run.complete_steps()[:2] == [0, 1]
    assert run.summary["status"] == "interrupted"
    run.assert_clean()


def test_ctrl_c_stops_a_child_that_inherited_sigint_ignored(tmp_path: Path) -> None:
    # A shell without job control starts background jobs (`.ci/run > log &`) with SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler; the supervisor always handles Ctrl-C, so its
    # child must too. Here the script's own SIGINT stands for the terminal's Ctrl-C reaching the child;
    # the loop is bounded so that a child that ignores it ends as "script_finished" instead of hanging.
    body = (
        "for step in range(200):\n    train_step()\n"
        "    if step == 2:\n        os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.005)\n"
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child, as from that shell
    try:
        run = profile(tmp_path, fault_script(body), "--warmup", "1", "--steps", "100000")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.code == exitcodes.INTERRUPTED, run.end()
    assert run.end()["status"] == "interrupted"
    assert [e["kind"] for e in run.trace.events if e.get("kind") == "interrupted"] == ["interrupted"]
    assert run.complete_steps()[:3] == [0, 1, 2]
    run.assert_outputs()
    run.assert_clean()


# a script that marks (in its cwd's parent) that it has run two steps, then runs on; IGNORE: it ignores
# Ctrl-C. Bounded, so that a supervisor that never stops it fails the test as "script_finished".
STUBBORN = """\
if IGNORE:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
for step in range(3000):
    train_step()
    if step == 1:
        open(os.path.join(os.path.dirname(os.getcwd()), "ready"), "w").close()
    time.sleep(0.01)
"""


@pytest.mark.parametrize(
    ("ignore", "escalated"),
    [(False, "SIGINT"), (True, "SIGKILL")],
    ids=["ctrl_c_reaches_memdoctor_only", "script_ignores_ctrl_c"],
)
def test_ctrl_c_always_ends_the_run_promptly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignore: bool, escalated: str
) -> None:
    """A Ctrl-C the child never sees (``kill -INT`` of memdoctor alone) is forwarded to it; a child
    that still runs on is killed; either way the run ends as interrupted, with its finished steps."""
    from memdoctor.launch import childrun, supervisor

    monkeypatch.setattr(childrun, "INTERRUPT_FORWARD_S", 0.5)
    monkeypatch.setattr(childrun, "INTERRUPT_KILL_S", 2.0)
    monkeypatch.setattr(supervisor, "INTERRUPT_KILL_S", 2.0)
    ready = tmp_path / "ready"
    sent: list[float] = []

    def ctrl_c_to_memdoctor_only() -> None:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if ready.exists():  # the supervisor is waiting for the child: its handler is installed
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=ctrl_c_to_memdoctor_only, daemon=True)
    sender.start()
    run = profile(
        tmp_path, fault_script(f"IGNORE = {ignore}\n" + STUBBORN), "--warmup", "1", "--steps", "100000"
    )
    sender.join(5)
    assert ready.exists() and sent, "the script never reached step 2"
    # from the Ctrl-C (not from the start: a busy machine takes long to start the child), well under
    # the ~30 s the script would still run
    assert time.monotonic() - sent[0] < 25
    assert run.code == exitcodes.INTERRUPTED
    end = run.end()
    assert end["status"] == "interrupted"
    recorded = [e["kind"] for e in run.trace.events if e.get("kind") == "interrupted"]
    if escalated == "SIGINT":  # the forwarded Ctrl-C: the child recorded where it was and exited 130
        assert recorded == ["interrupted"] and end["exit_code"] == exitcodes.INTERRUPTED
    else:  # killed: no event of its own, and the message says why the run ended so
        assert recorded == [] and end["signal"] == "SIGKILL"
        assert "did not stop within 2 s and was killed" in end["message"]
    assert run.complete_steps()[:2] == [0, 1]
    run.assert_outputs()
    run.assert_clean()


def test_timeout_stops_a_script_that_never_steps(tmp_path: Path) -> None:
    body = "model(x).sum().backward()\ntime.sleep(3600)\n"
    start = time.monotonic()
    run = profile(tmp_path, fault_script(body), "--timeout", "5")
    assert run.code == exitcodes.TIMEOUT
    assert time.monotonic() - start < 60
    run.assert_outputs()
    end = run.end()
    assert end["memdoctor_exit_code"] == exitcodes.TIMEOUT and end["status"] == "timeout"
    assert run.complete_steps() == []
    run.assert_clean()


# ------------------------------------------------------------------------------- scripts that cannot run

NOTEBOOK = '{\n "cells": [{"cell_type": "code", "source": ["import torch"]}],\n "nbformat": 4\n}\n'
NOT_RUNNABLE = {
    # name: (file, content, exit code, what the one line says)
    "notebook": ("train.ipynb", NOTEBOOK, exitcodes.USAGE_ERROR, "Jupyter notebook"),
    "markdown": (
        "notes.md",
        "# Notes\n\nTrain with lr 3e-5, then evaluate.\n",
        exitcodes.SCRIPT_FAILED,
        "notes.md:3",
    ),
    "syntax_error": ("train.py", "import torch\nx = (1,\ndef f(:\n", exitcodes.SCRIPT_FAILED, "train.py:3"),
    "indentation": ("train.py", "import torch\n  x = 1\n", exitcodes.SCRIPT_FAILED, "IndentationError"),
}


@pytest.mark.parametrize("case", list(NOT_RUNNABLE))
def test_a_script_that_cannot_run_is_one_line_and_writes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], case: str
) -> None:
    name, content, code, expected = NOT_RUNNABLE[case]
    make_dirs(tmp_path, None)
    script = tmp_path / "scripts" / name
    script.write_text(content)
    before = tree(tmp_path / "scripts")
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path / "cwd")
        assert main(["profile", "-o", str(out), str(script)]) == code
    assert time.monotonic() - start < 5, "refused before starting a child"
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert expected in err and "Traceback" not in err
    if code == exitcodes.SCRIPT_FAILED:
        assert "SyntaxError" in err or "IndentationError" in err
    assert not out.exists()
    Run(code, tmp_path, out, before).assert_clean()


def test_missing_module_with_dash_m(tmp_path: Path) -> None:
    make_dirs(tmp_path, None)
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path / "cwd")
        for key, value in CHILD_ENV.items():
            mp.setenv(key, value)
        code = main(["profile", "-o", str(out), "-m", "memdoctor_test_no_such_module"])
    run = Run(code, tmp_path, out, set())
    assert code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    assert run.end()["status"] == "exception" and "memdoctor_test_no_such_module" in run.end()["message"]
    assert run.summary["fault"]["exception_type"].endswith("ImportError")
    assert run.complete_steps() == []
    run.assert_clean()


def _unwritable(base: Path) -> Path:
    """An output folder that cannot be written: read-only for a normal user; root ignores file modes,
    so for root a folder in /sys, which not even root may create."""
    if os.geteuid() != 0:
        folder = base / "readonly"
        folder.mkdir()
        folder.chmod(0o555)
        return folder / "out"
    return Path("/sys/memdoctor-test-unwritable-output")


def test_unwritable_output_folder_is_one_line_and_writes_nothing_elsewhere(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = _unwritable(tmp_path)
    try:
        run = profile(tmp_path, fault_script("for _ in range(5):\n    train_step()\n"), out=out)
    finally:
        if out.parent != Path("/sys"):
            out.parent.chmod(0o755)
    assert run.code == exitcodes.USAGE_ERROR
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(out) in err and "cannot" in err and "-o" in err and "Traceback" not in err
    assert not out.exists()
    run.assert_clean()
    assert tree(tmp_path) <= {"scripts", "scripts/train.py", "cwd", "readonly"}


# ----------------------------------------------------------------------------------------- more faults


def test_raise_in_forward_at_step_3(runs: Runs) -> None:
    run = runs["raise_at_step_3"]
    assert run.code == exitcodes.SCRIPT_FAILED
    run.assert_outputs()
    trace = run.trace
    assert [(s.step, s.complete) for s in trace.steps] == [(0, True), (1, True), (2, True), (3, False)]
    event = trace.events[-1]
    assert (event["kind"], event["step"], event["phase"], event["module_name"]) == (
        "exception",
        3,
        "forward",
        "1",
    )
    assert "step 3" in run.end()["message"] and run.end()["steps_recorded"] == 3
    fault = run.summary["fault"]
    assert (fault["step"], fault["phase"], fault["module_name"]) == (3, "forward", "1")
    assert "at step 3, in the forward of 1" in run.summary["headline"]
    assert "at step 3, in the forward of 1" in (run.out / "report.html").read_text()
    run.assert_clean()


def _plain(path: Path) -> str:
    data = path.read_bytes()
    return gzip.decompress(data).decode() if path.suffix == ".gz" else data.decode()


def test_environment_and_secrets_never_reach_the_outputs(runs: Runs) -> None:
    """Only allow-listed environment variables are recorded; planted secrets (environment, argv) are not
    in the trace, the report or the summary."""
    run = runs["raise_at_step_3"]
    header = run.trace.header
    assert header["environment"] == {**CHILD_ENV, **ALLOWED_ENV}
    assert header["command"]["argv"] == ["--token", "<redacted>", "--api-key=<redacted>", "--lr", "0.1"]
    for name in OUTPUT_FILES:
        text = _plain(run.out / name)
        for secret in [*SECRET_ENV.values(), SECRET_ARG]:
            assert secret not in text, f"a planted secret reached {name}"
        for var in SECRET_ENV:
            assert var not in text, f"{var} reached {name}"


@pytest.mark.parametrize(
    ("case", "step", "error"), [("oom_at_step_0", 0, "MemoryError"), ("oom_at_step_3", 3, "OutOfMemoryError")]
)
def test_out_of_memory_names_the_step_and_the_module(runs: Runs, case: str, step: int, error: str) -> None:
    run = runs[case]
    assert run.code == exitcodes.OUT_OF_MEMORY
    run.assert_outputs()
    assert run.complete_steps() == list(range(step))
    end = run.end()
    assert end["status"] == "oom" and end["memdoctor_exit_code"] == exitcodes.OUT_OF_MEMORY
    assert f"ran out of memory at step {step} in forward of 1" in end["message"]
    event = run.trace.events[-1]
    assert (event["kind"], event["step"], event["phase"], event["module_name"]) == (
        "oom",
        step,
        "forward",
        "1",
    )
    assert event["exception_type"].endswith(error)
    summary = run.summary
    assert summary["fault"]["kind"] == "oom" and summary["status"] == "oom"
    assert summary["live_at_fault"] is not None and summary["live_at_fault"]["step"] == step
    sentence = f"out of memory at step {step}, in the forward of 1"
    assert sentence in summary["headline"] and sentence in (run.out / "report.html").read_text()
    run.assert_clean()


def test_nan_loss_completes_and_names_the_first_nonfinite_module(runs: Runs) -> None:
    run = runs["nan_loss"]
    assert run.code == exitcodes.OK
    run.assert_outputs()
    assert run.end()["status"] == "completed" and run.complete_steps() == [0, 1, 2, 3, 4, 5]
    flags = [f for f in run.summary["grad_flags"] if f["kind"] == "nonfinite"]
    assert [(f["module"], f["step"]) for f in flags] == [("2", 2)]  # the last Linear: first in backward
    norms = {row["step"]: row["global"] for row in run.summary["grad_norm"]}
    assert norms[1] is not None and norms[2] is None
    run.assert_clean()


def test_two_optimizers_count_one_step_per_training_step(runs: Runs) -> None:
    run = runs["two_optimizers"]
    assert run.code == exitcodes.OK
    run.assert_outputs()
    steps = run.trace.steps
    # steps 0 and 1 are the first iteration's two halves (the session learns the cycle), both warm-up
    assert [(s.step, s.warmup, s.complete) for s in steps] == [
        (0, True, True),
        (1, True, True),
        (2, False, True),
        (3, False, True),
        (4, False, True),
    ]
    assert run.summary["steps_profiled"] == 3
    for step in run.trace.profiled_steps():
        assert step.micro_batches == 2
        state = {m: sum(cols["optimizer_state_bytes"]) for m, cols in step.modules.items()}
        assert state[0] > 0 and state[1] > 0, state
    assert len(run.trace.models) == 2
    by_model = {m: 0 for m in (0, 1)}
    for row in run.summary["layers"]:
        by_model[row["model"]] += row["optimizer_state_bytes"] or 0
    assert by_model[0] > 0 and by_model[1] > 0
    run.assert_clean()


def test_dataloader_workers_do_not_break_the_run(runs: Runs) -> None:
    run = runs["dataloader_workers"]
    assert run.code == exitcodes.OK
    run.assert_outputs()
    assert run.end()["status"] == "completed" and run.complete_steps() == [0, 1, 2, 3]
    summary = run.summary
    assert summary["data"]["source"] == "dataloader"
    assert summary["dataloader_wait_fraction"] is not None and summary["dataloader_wait_fraction"] > 0.1
    run.assert_clean()


# ----------------------------------------------------------------------------------------- bad traces


def _report(tmp_path: Path, trace_bytes: bytes, capfd: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    trace = tmp_path / "trace.jsonl.gz"
    trace.write_bytes(trace_bytes)
    code = main(["report", "-o", str(tmp_path / "rendered"), str(trace)])
    return code, capfd.readouterr().err.strip().splitlines()


HEADER_LINE = '{"type":"header","format":"memdoctor-trace","format_version":1}\n'


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "not a gzip file"),
        (gzip.compress(b""), "empty trace file"),
        (gzip.compress(HEADER_LINE.replace(":1}", ":2}").encode() + b'{"type":"end"}\n'), "newer"),
    ],
    ids=["empty-file", "empty-gzip", "future-version"],
)
def test_empty_and_future_traces_are_one_line_exit_3(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], data: bytes, expected: str
) -> None:
    code, err = _report(tmp_path, data, capfd)
    assert code == exitcodes.TRACE_ERROR
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "rendered").exists()


def _model_line(n: int, name: str = "m") -> str:
    """A model record declaring ``n`` modules, written without building ``n`` Python objects."""

    def column(item: str) -> str:
        return "[" + ",".join([item] * n) + "]"

    parents = "[-1" + ",0" * (n - 1) + "]"
    return (
        '{"type":"model","model":0,"class":"M","modules":{'
        f'"name":{column(json.dumps(name))},"type":{column(chr(34) + "L" + chr(34))},"parent":{parents},'
        f'"param_bytes":{column("0")},"param_count":{column("0")},"trainable_param_bytes":{column("0")}'
        "}}\n"
    )


def test_ten_million_declared_layers_are_refused_quickly(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = gzip.compress((HEADER_LINE + _model_line(10**7) + '{"type":"end"}\n').encode(), compresslevel=1)
    start = time.monotonic()
    code, err = _report(tmp_path, data, capfd)
    assert time.monotonic() - start < 30
    assert code == exitcodes.TRACE_ERROR and len(err) == 1 and "larger than" in err[0]


def test_megabyte_long_names_are_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    data = gzip.compress((HEADER_LINE + _model_line(1, "x" * 2**20) + '{"type":"end"}\n').encode())
    code, err = _report(tmp_path, data, capfd)
    assert code == exitcodes.TRACE_ERROR and len(err) == 1 and "longer than" in err[0]


def test_absurdly_large_figures_still_render(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Values that are valid but absurd (a 10^30-byte peak, a megabyte-long event message) render."""
    from tests.tracebuilder import oom_trace

    records = oom_trace(2).records()
    for rec in records:
        if rec["type"] == "step":
            rec["memory"]["peak_bytes"] = 10**30
        if rec["type"] == "event":
            rec["message"] = "m" * 2**20
    text = "".join(json.dumps(r) + "\n" for r in records)
    code, err = _report(tmp_path, gzip.compress(text.encode()), capfd)
    assert code == exitcodes.OK, err
    html = (tmp_path / "rendered" / "report.html").read_text()
    assert "m" * 2**16 not in html  # the message was cut when loaded


# ------------------------------------------------------------------------------ the report loads nothing

CSP_RE = re.compile(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">')


def test_faulted_report_loads_nothing_from_the_network(runs: Runs) -> None:
    """The CSP of a real run's report forbids every network load: nothing but inline styles and data:
    images, no base URL, no form target; and the page names no remote resource."""
    html = (runs["raise_at_step_3"].out / "report.html").read_text()
    policies = CSP_RE.findall(html)
    assert len(policies) == 1
    directives = {d.split()[0]: d.split()[1:] for d in policies[0].split(";") if d.strip()}
    assert directives["default-src"] == ["'none'"]
    assert directives["base-uri"] == ["'none'"] and directives["form-action"] == ["'none'"]
    allowed = {src for sources in directives.values() for src in sources}
    assert allowed <= {"'none'", "data:", "'unsafe-inline'"}, allowed
    assert directives.get("img-src") == ["data:"] and "script-src" not in directives
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:|//|ftp:)""", html, re.I)


# ----------------------------------------------------------------------------------------- where, in words

HEADLINES = {
    "raise_at_import": "The script died of ModuleNotFoundError before its first training step",
    "raise_at_step_0": "The script died of ValueError at step 0, in the forward of 1",
    "exit_3_after_1": "The script called sys.exit(3) at step 1",  # between steps: in the next one
    "os_exit_after_2": "The script died of an abrupt exit with code 7 (os._exit, or native code ending the "
    "process) after 2 complete steps",
    "segfault_after_2": "The script died of a crash (SIGSEGV) after 2 complete steps",
    "sigkill_after_2": "The script was killed by SIGKILL after 2 complete steps",
}


@pytest.mark.parametrize("case", list(HEADLINES))
def test_the_headline_says_where_the_run_died(runs: Runs, case: str) -> None:
    run = runs[case]
    headline = run.summary["headline"]
    assert headline.startswith(HEADLINES[case]), headline
    assert HEADLINES[case] in " ".join((run.out / "report.html").read_text().split())


def test_a_fault_before_any_step_records_no_empty_step(runs: Runs) -> None:
    """Nothing ran, so nothing is shown as measured: no step of 0 B, no peak, no step in the fault."""
    run = runs["raise_at_import"]
    assert run.trace.steps == []
    summary = run.summary
    assert summary["peak_memory_bytes"] is None and summary["steps"] == []
    assert summary["fault"]["step"] is None and run.trace.events[-1]["step"] is None
