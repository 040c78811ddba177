"""A ``torch.compile``d function that steps the optimizer, under ``memdoctor profile`` with the FLOP
counter on (issue 19, point 7): the script trains to its end and every step is recorded.

Before, the counter popped its dispatch mode from the optimizer hook that runs inside the compiled
call; the call's return switched the Python dispatch key back on with no mode left, and the script's
next ``opt.zero_grad()`` died on an internal assert (``PythonFallbackKernel.cpp``). A script whose whole
training step is compiled had its steps never closed (no module call outside compiled code starts
one), and memdoctor's gradient and saved-tensor hooks, which its eager backward calls, were counted
as graph breaks among the script's. Each case is a real ``memdoctor profile`` run (a supervised
child), with dynamo's ``eager`` backend (no C compiler needed): slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memdoctor.cli import main
from memdoctor.trace import load_trace

pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.slow

# ``update``: the forward and backward run eagerly, only the optimizer step is compiled (the crash).
# ``whole``: forward, backward and optimizer step in one compiled function (the steps never closed).
SCRIPT = """\
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


@torch.compile(backend="eager")
def update():
    opt.step()


@torch.compile(backend="eager")
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


for i in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    if sys.argv[1] == "update":
        nn.functional.mse_loss(model(x), y).backward()
        update()
    else:
        train_step(x, y)
    opt.zero_grad()
print("trained to the end")
"""


def _profile(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], shape: str
) -> tuple[Any, dict[str, Any], str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        mp.setenv("OMP_NUM_THREADS", "1")
        code = main(["profile", "--warmup", "1", "--steps", "2", "-o", str(out), str(script), "--", shape])
    text = capfd.readouterr()
    assert code == 0, text.err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    return load_trace(out / "trace.jsonl.gz"), summary, text.out + text.err


def test_a_compiled_optimizer_step_trains_to_the_end_with_its_flops_counted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace, summary, output = _profile(tmp_path, capfd, "update")
    assert "trained to the end" in output and "INTERNAL ASSERT" not in output
    assert [s.step for s in trace.steps if s.complete] == [0, 1, 2]
    assert summary["steps_profiled"] == 2
    flops = trace.steps[0].collectors["flops"]  # the measured step: the eager forward and backward
    assert flops["complete"] and flops["flops"]["forward"] > 0 and flops["flops"]["backward"] > 0


def test_a_wholly_compiled_training_step_records_its_steps_and_says_the_flops_were_not_counted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trace, summary, output = _profile(tmp_path, capfd, "whole")
    assert "trained to the end" in output and "INTERNAL ASSERT" not in output
    assert [s.step for s in trace.steps if s.complete] == [0, 1, 2]
    assert summary["steps_profiled"] == 2
    # The backward runs eagerly inside the compiled call: memdoctor's gradient and saved-tensor hooks
    # stay out of dynamo (before: a dozen breaks at their storage reads, "Unsupported method call").
    reasons = {r["reason"] for r in trace.collected["compile"]["break_reasons"]}
    assert "Unsupported method call" not in reasons
    # No module call runs outside the compiled code: the counter never started, and says so.
    assert not any("flops" in s.collectors for s in trace.steps)
    assert summary["flops_per_step"] is None
    note = trace.collected["flops"]["not_measured"]
    assert "torch.compile" in note and any(
        n == f"flops: not measured in {note}" for n in summary["not_measured"]
    )
