"""Bad input and dying scripts, for real: each case profiles a tiny fault script in a supervised child.

Every script is a small ``nn.Linear`` + SGD loop written into ``<tmp>/scripts`` (its folder), run from an
empty ``<tmp>/cwd`` with its outputs in ``<tmp>/out``: each case checks the exit code, what the trace,
report and summary say, that the measured steps are kept, and that memdoctor wrote nothing beside the
script or into the working folder. Runs go through ``memdoctor.cli.main`` in-process, except Ctrl-C,
which is sent to a ``python -m memdoctor`` process group as a terminal would.

Runs that several tests read are made once (``runs`` caches them).
"""

from __future__ import annotations

import json
import os
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

# A tiny model whose middle module can be told to raise on its n-th forward call (FAIL_AT).
PRELUDE = """\
import os
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
            raise ValueError(f"flaky forward failed on call {self.calls}")
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


def fault_script(body: str, *, fail_at: int = -1, before: str = "") -> str:
    return before + f"FAIL_AT = {fail_at}\n" + PRELUDE + body


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
    base: Path, source: str | None, *options: str, out: Path | None = None, args: tuple[str, ...] = ()
) -> Run:
    """``memdoctor profile OPTIONS -o OUT base/scripts/train.py -- ARGS``, in-process, from ``base/cwd``."""
    script = make_dirs(base, source) if not (base / "scripts").exists() else base / "scripts" / "train.py"
    out = out or base / "out"
    before = tree(base / "scripts")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base / "cwd")
        for key, value in CHILD_ENV.items():
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
    "no_optimizer_step": (
        fault_script("for _ in range(3):\n    model(x).sum().backward()\n    optimizer.zero_grad()\n"),
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
}


class Runs:
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[str, Run] = {}

    def __getitem__(self, case: str) -> Run:
        if case not in self.done:
            source, options = CASES[case]
            self.done[case] = profile(self.factory.mktemp(case), source, *options)
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


def test_no_optimizer_step(runs: Runs) -> None:
    run = runs["no_optimizer_step"]
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
    ready = threading.Event()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines, ready), daemon=True)
    reader.start()
    try:
        assert ready.wait(90), f"the script never printed READY: {''.join(lines)}"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == exitcodes.INTERRUPTED, err
    assert "Traceback" not in err, err
    run = Run(proc.returncode, tmp_path, out, before)
    run.assert_outputs()
    assert run.end()["status"] == "interrupted"
    assert run.complete_steps()[:2] == [0, 1]
    assert run.summary["status"] == "interrupted"
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
