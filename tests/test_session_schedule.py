"""Timing steps: on a device with an allocator, only the warm-up, first and last profiled steps carry
the per-module ledger; the steps between run with the optimizer hooks alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memdoctor.capture.session import ProfileSession
from memdoctor.device import FakeDevice
from memdoctor.trace import StepRecord


def _train(session: ProfileSession, steps: int, seen_hooks: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with session:
        for _ in range(steps):
            seen_hooks.append(len(torch.nn.modules.module._global_forward_pre_hooks))
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break


def test_middle_steps_are_timing_steps_without_module_hooks() -> None:
    records: list[dict] = []
    session = ProfileSession(steps=4, warmup=1, device=FakeDevice(), sink=records.append)
    hooks: list[int] = []
    _train(session, 8, hooks)
    steps = [StepRecord.from_record(r) for r in records if r["type"] == "step"]
    final = {s.step: s for s in steps}  # a provisional record is superseded by the step's final one
    assert sorted(final) == [0, 1, 2, 3, 4]
    assert [final[i].detail for i in range(5)] == ["full", "full", "timing", "timing", "full"]
    for i in (2, 3):
        assert final[i].modules == {} and final[i].memory["categories_at_peak"] is None
    for i in (0, 1, 4):
        assert final[i].modules[0]["activation_bytes"][0] > 0
    # module hooks were installed for steps 0-1 and 4 only (seen at the top of each step's loop)
    assert hooks[:5] == [1, 1, 0, 0, 1]
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_cpu_profiles_every_step_in_full() -> None:
    records: list[dict] = []
    session = ProfileSession(steps=3, warmup=1, sink=records.append)
    _train(session, 6, [])
    details = {r["step"]: r["detail"] for r in records if r["type"] == "step"}
    assert details == {0: "full", 1: "full", 2: "full", 3: "full"}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_is_not_a_new_forward(reentrant: bool) -> None:
    # Recomputed forwards run inside backward; non-reentrant checkpointing stops them early by
    # raising. Neither may leave frames on the module stack or start a new micro-batch or step.
    records: list[dict] = []
    session = ProfileSession(steps=3, warmup=1, sink=records.append)
    model = _Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    depth_after_backward = []
    with session:
        for _ in range(6):
            model(torch.randn(4, 8, requires_grad=reentrant)).sum().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
            with torch.no_grad():  # a forward outside backward: stale frames would show here
                model(torch.randn(2, 8))
            if not session._done:  # (the forward that closes the last step stops the session)
                depth_after_backward.append(len(session._stack))
    final = {r["step"]: r for r in records if r["type"] == "step"}
    assert sorted(final) == [0, 1, 2, 3]
    assert all(r["micro_batches"] == 1 for r in final.values())
    assert set(depth_after_backward) == {0}
    # the blocks' activations were measured in forward, not lost to the recomputation
    names = (
        records[0]["modules"]["0"]["name"] if "name" in records[0].get("modules", {}).get("0", {}) else None
    )
    assert names is None  # model records carry names, step records only columns
    assert final[2]["modules"]["0"]["forward_ms"][0] is not None
