"""Every collector on every parameter dtype (float64, float16, bfloat16 and a mix), on the CPU: none
fails, every one records its figures, and the summary says what the parameters are. Each run profiles
with every collector (the FLOP counter included), so this file stays out of the fast subset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memdoctor
from memdoctor.report import build_summary
from memdoctor.trace import load_trace


def _cast(dtype: Any) -> tuple[nn.Module, torch.dtype]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
    if dtype == "mixed":  # a bf16 head behind fp32 layers, as a script casting one part would have
        model[3] = Upcast(nn.Linear(16, 2).to(torch.bfloat16))
        return model, torch.float32
    return model.to(dtype), dtype


class Upcast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16)).float()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, "mixed"])
def test_every_collector_handles_every_parameter_dtype(dtype: Any, tmp_path: Path) -> None:
    model, input_dtype = _cast(dtype)
    with memdoctor.profile(tmp_path / "out", steps=2, warmup=1, collect="all") as prof:
        # SGD: AdamW's eps (1e-8) is 0 in fp16, and the script's own step would make NaNs
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(4):
            model(torch.randn(4, 8, dtype=input_dtype)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert prof.status == "completed"
    trace = load_trace(tmp_path / "out" / "trace.jsonl.gz")
    assert not [e for e in trace.events if e.get("kind") == "collector_failed"]
    last = trace.steps[-1]
    assert {"histograms", "precision"} <= set(last.collectors)
    assert last.grad_norm is not None and last.grad_norm["global"] is not None
    summary = build_summary(trace)
    params = summary["script_precision"]["parameters"]
    expected = {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}
    assert params == expected.get(dtype) or (dtype == "mixed" and params.startswith("mixed (fp32"))
