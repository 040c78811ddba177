"""fp16 with a ``torch.amp.GradScaler``: a step the scaler skips (Inf/NaN gradients) stays one training
step, marked skipped, instead of merging with the next one; the loss scale is recorded per step; the
gradient health flags call skips what they are; the precision section reads gradients unscaled."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import memdoctor
from memdoctor.analysis import histograms as precision
from memdoctor.report import build_summary
from memdoctor.trace import load_trace


def _train(steps: int, inf_at: set[int], init_scale: float = 2.0**10) -> list[float]:
    """A tiny fp16-autocast loop on the CPU with a GradScaler; an Inf in the input at ``inf_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scales = []
    for i in range(steps):
        x = torch.randn(4, 8)
        if i in inf_at:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return scales


def test_a_skipped_step_is_its_own_step_with_the_scale_recorded(tmp_path: Path) -> None:
    with memdoctor.profile(tmp_path / "out", steps=4, warmup=1, collect="histograms") as prof:
        scales = _train(6, inf_at={2})[:5]
    assert prof.status == "completed"
    trace = load_trace(tmp_path / "out" / "trace.jsonl.gz")
    assert [s.step for s in trace.steps] == [0, 1, 2, 3, 4]
    assert all(s.micro_batches == 1 for s in trace.steps)  # not merged into "accumulation"
    assert [bool(s.grad_scaler and s.grad_scaler["skipped"]) for s in trace.steps] == [0, 0, 1, 0, 0]
    assert [s.grad_scaler["scale"] for s in trace.steps if s.grad_scaler] == scales  # halved after the skip
    summary = build_summary(trace)
    kinds = [f["kind"] for f in summary["grad_flags"]]
    assert kinds == ["scaler_skipped"]  # not a NaN alarm: the scaler kept the Inf out of the weights
    assert "skipped 1 of 5 steps" in summary["grad_flags"][0]["evidence"]
    assert all(g["global"] is not None for g in summary["grad_norm"])  # the skipped step is left out
    assert [g["step"] for g in summary["grad_norm"]] == [0, 1, 3, 4]


def test_every_step_skipped_is_a_nonfinite_flag(tmp_path: Path) -> None:
    with memdoctor.profile(tmp_path / "out", steps=2, warmup=1, collect="none"):
        _train(3, inf_at={0, 1, 2})
    summary = build_summary(load_trace(tmp_path / "out" / "trace.jsonl.gz"))
    assert [f["kind"] for f in summary["grad_flags"]] == ["nonfinite"]
    assert "every step" in summary["grad_flags"][0]["evidence"]


def test_precision_reads_gradients_divided_by_the_recorded_scale(tmp_path: Path) -> None:
    """Two runs that differ only in the loss scale give the same unscaled gradient ranges."""
    maxima = []
    for k, scale in enumerate((2.0**4, 2.0**12)):
        out = tmp_path / f"out{k}"
        with memdoctor.profile(out, steps=2, warmup=1, collect="histograms"):
            _train(3, inf_at=set(), init_scale=scale)
        entries = precision.entries(load_trace(out / "trace.jsonl.gz"))
        grads = [e for e in entries if e.direction == "backward" and e.numel > 1]
        assert grads and all(e.unscaled and not e.scaled for e in grads)
        maxima.append([e.abs_max for e in grads])
    for a, b in zip(*maxima, strict=True):
        assert abs(a - b) <= 1e-2 * max(a, b)  # fp16 rounding of the scaled values only


def test_the_scaler_patch_is_removed_and_a_disabled_scaler_is_left_alone(tmp_path: Path) -> None:
    original = torch.amp.GradScaler.step
    with memdoctor.profile(tmp_path / "out", steps=1, warmup=1, collect="none"):
        assert torch.amp.GradScaler.step is not original
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for _ in range(2):
            scaler.scale(model(torch.randn(2, 4)).sum()).backward()
            scaler.step(opt)
            opt.zero_grad()
    assert torch.amp.GradScaler.step is original
    trace = load_trace(tmp_path / "out" / "trace.jsonl.gz")
    assert all(s.grad_scaler is None for s in trace.steps)  # a disabled scaler scales nothing
