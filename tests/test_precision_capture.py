"""The precision collector on tiny CPU models, every collector on every parameter dtype, memdoctor's own
failures kept out of the script, and the autocast lever on a script that autocasts itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.analysis.summary import not_measured
from memdoctor.capture import gradnorms
from memdoctor.capture.collectors import make_collectors
from memdoctor.capture.precision import PrecisionCollector
from memdoctor.capture.session import ProfileSession
from memdoctor.config import GradScalerSettings
from memdoctor.levers.autocast import LossScaling, autocast_forward
from tests.tracebuilder import trace_from_records


class Block(nn.Module):
    """A Linear, then a LayerNorm run with autocast switched off (as models do for a numerically
    sensitive part): the collector must see autocast off there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            return self.norm(h.float())


def _profile(model: nn.Module, make_input: Any, autocast: torch.dtype | None = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    collectors, _ = make_collectors(["precision"])
    session = ProfileSession(steps=2, warmup=1, sink=records.append, collectors=collectors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with session:
        for _ in range(4):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(make_input())
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    return records


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("type") == "step"]


def test_autocast_in_force_is_recorded_per_module_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(8, 2))
    records = _profile(model, lambda: torch.randn(4, 8), autocast=torch.bfloat16)
    step = _steps(records)[-1]
    cols = step["modules"]["0"]
    # root, block, block.fc, block.norm, head
    assert cols["autocast_bits"] == [16, 16, 16, 0, 16]  # the norm runs with autocast switched off
    assert cols["output_bits"] == [16, 32, 16, 32, 16]
    field = step["collectors"]["precision"]
    assert field["forwards"] == 5 and field["autocast_forwards"] == {"bfloat16": 4}
    # leaf outputs: fc 4x8 bf16, norm 4x8 fp32, head 4x2 bf16
    assert field["output_bytes"] == {"bfloat16": 4 * 8 * 2 + 4 * 2 * 2, "float32": 4 * 8 * 4}
    assert field["parameter_bytes"] == {"float32": sum(p.numel() * 4 for p in model.parameters())}
    assert set(field["tf32"]) == {"matmul", "cudnn", "float32_matmul_precision"}


def test_without_autocast_every_forward_is_off() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    field = _steps(_profile(model, lambda: torch.randn(4, 8)))[-1]["collectors"]["precision"]
    assert field["autocast_forwards"] == {} and field["forwards"] == 3


def test_a_failing_gradient_norm_is_memdoctors_not_the_scripts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(*_: Any) -> Any:
        raise TypeError("our own bug")

    monkeypatch.setattr(gradnorms, "collect", broken)
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=1, sink=records.append)
    model = nn.Sequential(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with session:
        for _ in range(4):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()  # the script's own call: must not raise memdoctor's error
            opt.zero_grad()
    assert session.steps_recorded == 3
    failed = [r for r in records if r.get("kind") == "collector_failed"]
    assert len(failed) == 1 and "gradient norms" in failed[0]["message"]  # said once, then off
    trace = trace_from_records(tmp_path / "t.jsonl.gz", records)
    assert any("our own bug" in n for n in not_measured(trace))


@pytest.mark.parametrize(
    ("script", "config", "expect", "told"),
    [
        # no autocast of its own: the config's applies (bf16 values), and the output a loss outside the
        # model gets is fp32 (``to_float32``)
        (None, "bf16", torch.float32, False),
        (torch.bfloat16, "bf16", torch.bfloat16, False),  # the same: nothing doubled, nothing said
        (torch.bfloat16, "fp16", torch.bfloat16, True),  # another dtype: the script's kept, and said
    ],
)
def test_the_autocast_lever_keeps_a_scripts_own_autocast(
    script: torch.dtype | None, config: str, expect: torch.dtype, told: bool
) -> None:
    said: list[str] = []
    model = nn.Linear(4, 4)
    undo = autocast_forward(model, config, said.append)
    try:
        for _ in range(2):
            with torch.autocast("cpu", dtype=script or torch.bfloat16, enabled=script is not None):
                out = model(torch.randn(2, 4))
            assert out.dtype == expect
            assert torch.equal(out, out.bfloat16().to(out.dtype))  # computed in bf16 in every case
    finally:
        undo()
    assert len(said) == (1 if told else 0)
    if told:
        assert "precision fp16 not applied" in said[0] and "own bfloat16 autocast" in said[0]


def test_a_collector_that_fails_to_start_is_not_measured_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, **_: Any) -> None:
        raise KeyError("our own bug")

    monkeypatch.setattr(PrecisionCollector, "__init__", broken)
    made, notes = make_collectors(["precision"])
    assert made == []
    assert notes == ["precision: the collector failed to start: KeyError: 'our own bug'"]


def test_fp16_loss_scaling_stands_down_where_the_scripts_autocast_is_kept() -> None:
    model = nn.Linear(4, 4)
    scaling = LossScaling(GradScalerSettings(), model, fail=pytest.fail)
    undo = autocast_forward(model, "fp16", None, scaling.stand_down)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).float().sum()
    finally:
        undo()
    assert scaling.off
    assert scaling.scale(loss) is loss  # the script's bf16 loss is not scaled by a GradScaler of ours
    assert scaling.scaler is None
    assert float(scaling.current_scale(loss)) == 1.0


def test_fp16_loss_scaling_stands_down_under_the_scripts_own_fp16_autocast_too() -> None:
    """A script autocasting fp16 by itself scales its own loss (or chose not to): ours would double it."""
    model = nn.Linear(4, 4)
    scaling = LossScaling(GradScalerSettings(), model, fail=pytest.fail)
    said: list[str] = []
    undo = autocast_forward(model, "fp16", said.append, scaling.stand_down)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(2, 4))
    finally:
        undo()
    assert scaling.off and said == []  # the same dtype: nothing to say
