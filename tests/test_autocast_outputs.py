"""The autocast memdoctor adds around a model's forward hands a loss computed outside it fp32 outputs,
as the script wrote its loss for (dcgan's ``BCELoss`` with fp32 targets refused a 16-bit input); a
forward that returns its own loss keeps its outputs as autocast made them."""

from __future__ import annotations

import torch
from torch import nn

from memdoctor.levers.autocast import autocast_forward, to_float32


def test_a_loss_outside_the_model_gets_fp32_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Sigmoid())
    undo = autocast_forward(model, "bf16")
    try:
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.float32
        loss = nn.BCELoss()(out, torch.ones(3, 1))  # refuses a bf16 input next to fp32 targets
        loss.backward()
    finally:
        undo()
    assert model[0].weight.grad is not None


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": logits.float().pow(2).mean()}


def test_a_forward_that_returns_its_loss_keeps_its_outputs() -> None:
    model = WithLoss()
    undo = autocast_forward(model, "bf16")
    try:
        out = model(torch.randn(3, 4))
    finally:
        undo()
    assert out["logits"].dtype == torch.bfloat16  # no fp32 copy of (an LM's large) logits


def test_only_16_bit_tensors_in_plain_containers_are_cast() -> None:
    h, i = torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.int64)
    out = to_float32((h, [h, i], {"a": h}, "text"))
    assert (
        out[0].dtype == torch.float32 and out[1][0].dtype == torch.float32 and out[1][1].dtype == torch.int64
    )
    assert out[2]["a"].dtype == torch.float32 and out[3] == "text"
