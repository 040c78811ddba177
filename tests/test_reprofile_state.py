"""No re-profile at a smaller micro-batch where none can help: the model's state alone (parameters,
gradients, optimizer state, which a smaller micro-batch does not shrink) exceeds the budget. Known from
the first run's model record and ledger even when it died in its first step (a 1.1B fp32 decoder under
8 GiB re-profiled three times in vain before this)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor import exitcodes
from memdoctor.capture.session import ProfileSession
from memdoctor.cli import main
from memdoctor.launch.reprofile import reprofile
from memdoctor.plan.reprofiled import RECORD_NAME, model_state, state_beyond
from memdoctor.report import build_summary
from memdoctor.trace import Trace
from memdoctor.units import format_bytes
from tests.test_reprofile import OOM_LOOP, FakeRunner, _request
from tests.tracebuilder import TraceBuilder, bert_like

LAST = "bert.encoder.layer.1"
MODEL = bert_like(layers=2, batch=2, seq=64, hidden=128)  # a small BERT: 17.5 MB of fp32 parameters
P = sum(m[2] for m in MODEL)


def _died_in_backward(budget: int, optimizers: bool = True) -> Trace:
    """The small BERT's run that ran out of memory in its first step's backward, before any optimizer
    step; ``optimizers``: whether the model record names its AdamW (parameters x4 of state with it)."""
    b = TraceBuilder(kind="cuda", budget_bytes=budget)
    b.add_model(MODEL)
    if not optimizers:
        b.models[0].info.optimizers = []
    b.add_step(warmup=True, die_at=("backward", LAST))
    index = b.models[0].info.names.index(LAST)
    b.add_event("oom", "out of memory", step=0, phase="backward", model=0, module=index, module_name=LAST)
    return b.end("oom", "CUDA out of memory during step 0", exit_code=1).build()


def test_the_state_is_known_from_the_model_record_before_any_optimizer_step() -> None:
    trace = _died_in_backward(3 * P)
    params = sum(trace.models[0].param_bytes)
    assert trace.steps[0].memory["categories_at_peak"]["optimizer_state"] == 0  # never measured
    total, parts = model_state(trace, ["AdamW"])
    assert total == 4 * params  # parameters, one gradient and two moments per parameter byte
    assert "of optimizer state" in parts
    total, parts = model_state(trace, [])  # an optimizer never seen: its state is not counted
    assert total == 2 * params and "optimizer" not in parts
    assert model_state(trace, ["SGD"])[0] == 2 * params
    assert state_beyond(trace, ["AdamW"], 4 * params) is None
    assert "exceeds the" in (state_beyond(trace, ["AdamW"], 4 * params - 1) or "")


def test_no_reprofile_when_the_state_alone_exceeds_the_budget(tmp_path: Path) -> None:
    trace = _died_in_backward(3 * P)  # 4 x P of state against 3 x P
    summary = build_summary(trace)
    assert summary["steps_found"]["optimizers"] == ["AdamW"]
    runner = FakeRunner([])
    lines: list[str] = []
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert runner.requests == [] and record["rounds"] == [] and record["workload"] is None
    assert record["stopped"].startswith(
        f"the model's state alone ({format_bytes(P)} of parameters + {format_bytes(P)} of gradients + "
        f"{format_bytes(2 * P)} of optimizer state = {format_bytes(4 * P)})"
    )
    assert "does not shrink" in record["stopped"] and f"{format_bytes(3 * P)} budget" in record["stopped"]
    assert len(lines) == 2 and record["stopped"] in lines[-1]
    trace.collected[RECORD_NAME] = record
    after = build_summary(trace)
    assert after["reprofile"]["stopped"] == record["stopped"] and after["reprofile"]["rounds"] == []
    assert record["stopped"] in after["plan"]["advice"][0]


def test_a_round_that_learns_the_optimizer_stops_the_halving(tmp_path: Path) -> None:
    """The first run died before its optimizer was seen: parameters and gradients (2 x P) fit 3 x P, so
    a round runs; it died again, its model record naming AdamW, and no second round runs."""
    trace = _died_in_backward(3 * P, optimizers=False)
    summary = build_summary(trace)
    assert not (summary["steps_found"] or {}).get("optimizers")
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, _died_in_backward(3 * P))] * 3)
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=3)
    assert len(runner.requests) == 1 and len(record["rounds"]) == 1
    assert record["stopped"].startswith("at micro-batch 1/2, the model's state alone")


def test_a_state_that_fits_still_reprofiles(tmp_path: Path) -> None:
    trace = _died_in_backward(5 * P)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, _died_in_backward(5 * P, optimizers=False))] * 3)
    record = reprofile(trace, build_summary(trace), _request(tmp_path), runner, lambda _: None, max_rounds=3)
    assert len(runner.requests) >= 1 and "state alone" not in (record["stopped"] or "")


@pytest.mark.slow
def test_profile_does_not_reprofile_a_model_whose_state_exceeds_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real supervisor on the tiny CPU loop that 'runs out of memory' at its head: 297 KiB of
    parameters and as many gradients against a 512 KiB budget."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(OOM_LOOP)
    argv = ["profile", "--warmup", "0", "--steps", "2", "--budget", "512KiB", "-o", "out", "loop.py"]
    assert main(argv) == exitcodes.OUT_OF_MEMORY
    rp = json.loads((tmp_path / "out" / "summary.json").read_text())["reprofile"]
    assert rp["rounds"] == [] and not rp["planned_from_reprofile"]
    assert rp["stopped"].startswith("the model's state alone") and "512.00 KiB budget" in rp["stopped"]
    assert not (tmp_path / "out" / "reprofile").exists()
    assert "reprofile: the model's state alone" in capsys.readouterr().err


class _Wrapper(torch.optim.Optimizer):
    """Stands in for accelerate's ``AcceleratedOptimizer``: an Optimizer holding the real one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups


def test_a_run_that_dies_before_its_first_optimizer_step_still_names_its_optimizer() -> None:
    """The model is described at the fault with the live optimizers that hold its parameters (not a
    wrapper of one), so that its AdamW state counts before it was ever created."""
    records: list[dict[str, Any]] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters())
    wrapper = _Wrapper(opt)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # another model's: not this one's
    session = ProfileSession(steps=1, warmup=0, sink=records.append)
    session.start()
    try:
        model(torch.randn(2, 4)).sum().backward()  # dies before opt.step(): the fault path asks where
        session.where()
    finally:
        session.stop()
    (rec,) = [r for r in records if r.get("type") == "model"]
    assert [o["class"] for o in rec["optimizers"]] == ["AdamW"]
    assert rec["optimizers"][0]["param_count"] == 4 * 4 + 4 + 4 + 1
    del wrapper, other
