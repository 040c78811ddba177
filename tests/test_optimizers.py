"""Two optimizers in one training step: a step is counted once per training step, and both
optimizers' state is attributed to the modules they train.

Two shapes: separate parameter groups stepped one after the other (``opt_a.step(); opt_b.step()``), and
a GAN, whose discriminator steps before the generator's forward and backward run. The session learns
which optimizers make one training step from the order they step in; on a device with an allocator the
timing steps between the ledger steps must end after the last of them too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.capture.session import ProfileSession
from memdoctor.device import Device, FakeDevice
from memdoctor.trace import StepRecord


def _train(session: ProfileSession, gan: bool, iterations: int = 20) -> list[int]:
    """A generator ``g`` (model 1, Adam) and a discriminator ``d`` (model 0, SGD with momentum);
    returns the step the session says the script is in at the top of each iteration."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(d.parameters(), lr=1e-3, momentum=0.9)
    at: list[int] = []
    with session:
        for _ in range(iterations):
            at.append(session.current_step())
            fake = g(torch.randn(16, 4))
            if gan:
                loss_d = d(torch.randn(16, 4)).mean() - d(fake.detach()).mean()
                opt_d.zero_grad()
                loss_d.backward()
                opt_d.step()
                loss_g = -d(fake).mean()  # a forward after the discriminator's step: same training step
                opt_g.zero_grad()
                loss_g.backward()
                opt_g.step()
            else:
                d(fake).mean().backward()
                opt_d.step()
                opt_g.step()
                opt_d.zero_grad()
                opt_g.zero_grad()
            if session._done:
                break
    return at


def _steps(device: Device | None, gan: bool, warmup: int = 1) -> tuple[dict[int, StepRecord], list[int]]:
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=4, warmup=warmup, device=device, sink=records.append)
    at = _train(session, gan)
    # a provisional record is superseded by the step's final one
    return {r["step"]: StepRecord.from_record(r) for r in records if r["type"] == "step"}, at


def _opt_state(step: StepRecord) -> dict[int, int]:
    return {m: sum(cols["optimizer_state_bytes"]) for m, cols in step.modules.items()}


@pytest.mark.parametrize("device", [None, FakeDevice()], ids=["cpu", "timing-steps"])
def test_optimizers_stepped_one_after_the_other_make_one_step(device: Device | None) -> None:
    steps, at = _steps(device, gan=False)
    assert sorted(steps) == [0, 1, 2, 3, 4]  # 1 warm-up + 4, one per training step
    assert at[:5] == [0, 1, 2, 3, 4], "a training step was counted as two"
    assert [s.warmup for s in steps.values()] == [True, False, False, False, False]
    for step in steps.values():
        if step.detail == "full":
            state = _opt_state(step)
            assert set(state) == {0, 1} and state[0] > 0 and state[1] > 0, state


@pytest.mark.parametrize("device", [None, FakeDevice()], ids=["cpu", "timing-steps"])
def test_gan_steps_are_whole_training_steps(device: Device | None) -> None:
    steps, at = _steps(device, gan=True)
    # Until the discriminator steps again the session cannot know the generator's step belongs to the
    # same training step: steps 0 and 1 are its two halves, and both count as warm-up.
    assert sorted(steps) == [0, 1, 2, 3, 4, 5]
    assert [s.warmup for s in steps.values()] == [True, True, False, False, False, False]
    assert at[:5] == [0, 2, 3, 4, 5], "after the first iteration a training step must be one step"
    profiled = [s for s in steps.values() if not s.warmup]
    assert all(s.complete for s in profiled)
    for step in profiled:
        if step.detail == "full":
            assert step.micro_batches == 2  # the discriminator's backward and the generator's
            state = _opt_state(step)
            assert state[0] > 0 and state[1] > 0, state
    if device is not None:
        assert [steps[i].detail for i in range(6)] == ["full", "full", "full", "timing", "timing", "full"]


def test_gan_with_two_warmup_steps_keeps_the_requested_warmup() -> None:
    steps, _ = _steps(None, gan=True, warmup=2)
    assert [s.warmup for s in steps.values()] == [True, True, False, False, False, False]
    assert all(s.micro_batches == 2 for s in steps.values() if not s.warmup)


def test_one_optimizer_is_unchanged() -> None:
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=3, warmup=1, sink=records.append)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with session:
        for _ in range(6):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert sorted(steps) == [0, 1, 2, 3] and session.warmup == 1


def _pattern(session: ProfileSession, schedule: list[str]) -> list[tuple[int, int]]:
    """Run one forward, backward and step of optimizer ``a`` or ``b`` per entry of ``schedule``; returns
    (step, micro-batches) of every step recorded, final records only."""
    torch.manual_seed(0)
    models = {name: nn.Linear(4, 2) for name in "ab"}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in models.items()}
    records: list[dict[str, Any]] = []
    session.sink = records.append
    with session:
        for name in schedule:
            models[name](torch.randn(3, 4)).sum().backward()
            opts[name].step()
            opts[name].zero_grad()
            if session._done:
                break
    final = {r["step"]: r for r in records if r["type"] == "step"}
    return [(step, rec["micro_batches"]) for step, rec in sorted(final.items())]


def test_a_critic_stepping_several_times_per_generator_step() -> None:
    """WGAN: 3 critic steps per generator step. Once a whole cycle was seen, a step is one cycle: the
    critic repeating alone does not shrink the cycle back to the critic."""
    session = ProfileSession(steps=3, warmup=6, sink=None)
    steps = _pattern(session, ["a", "a", "a", "b"] * 10)
    # steps 0-2: single critic steps; then the generator's step joins the next critic steps until the
    # cycle {a, b} is learned at the 2nd round; from then every step is a whole round of 4 micro-batches
    assert [mb for _, mb in steps[-4:]] == [4, 4, 4, 4], steps


def test_switching_to_another_optimizer_closes_steps_again() -> None:
    """A script that moves on to a second optimizer (a new phase): the first one leaves the cycle as soon
    as the second has stepped twice without it, so steps close again at once."""
    session = ProfileSession(steps=5, warmup=1, sink=None)
    steps = _pattern(session, ["a"] * 3 + ["b"] * 20)
    assert session._done, "the steps never closed after the switch"
    assert [mb for _, mb in steps] == [1, 1, 1, 3, 1, 1], steps  # one step holds the switch


def test_an_optimizer_that_stops_stepping_leaves_the_cycle() -> None:
    """Both optimizers stepped in turn, then one stops (a frozen discriminator): after a while steps close
    at every step of the other again."""
    session = ProfileSession(steps=6, warmup=1, sink=None)
    steps = _pattern(session, ["a", "b"] * 4 + ["b"] * 100)
    assert session._done
    # two warm-up halves, whole steps of two, one long step while `a` goes stale, then single steps
    assert [mb for _, mb in steps] == [1, 1, 2, 2, 2, 32, 1, 1], steps
