"""The DataLoader split (``accumulation_split: loader``) under a loop that reads one batch ahead.

``accelerate``'s prepared DataLoader fetches the next batch before it hands over the current one (to
know which is the last), so micro-batch j+1 is fetched while the loop trains on micro-batch j. The split
must still defer the optimizer step, the scheduler and ``zero_grad`` to each batch's last micro-batch
*as trained*: gradients at every optimizer step, the step count, the LR schedule and the parameters
after two epochs equal the unsplit run's (fp32). In-process, on a generator in accelerate's shape and on
accelerate's own prepared loader; a loader read two ahead stops the run by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.levers.install import install

TOL = 1e-5
Loop = Callable[[nn.Module, torch.optim.Optimizer, Any], tuple[nn.Module, torch.optim.Optimizer, Any]]


def ahead(loader: Iterable[Any], depth: int = 1) -> Iterator[Any]:
    """Yield ``loader``'s batches, fetching ``depth`` beyond the one yielded (accelerate's shape)."""
    it = iter(loader)
    window = []
    for batch in it:
        window.append(batch)
        if len(window) > depth:
            yield window.pop(0)
    yield from window


class OneAhead:
    """A prepared loader in accelerate's shape: each epoch a new iterator, one batch ahead."""

    def __init__(self, loader: Iterable[Any], depth: int = 1) -> None:
        self.loader, self.depth = loader, depth

    def __iter__(self) -> Iterator[Any]:
        return ahead(self.loader, self.depth)


def _as_is(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[Any, Any, Any]:
    return model, opt, OneAhead(loader)


def _accelerate(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator

    prepared: tuple[Any, Any, Any] = Accelerator(cpu=True).prepare(model, opt, loader)
    return prepared


def _train(prepare: Loop, peek: bool = False) -> dict[str, Any]:
    """Two epochs of a loop computing the loss itself over 3 batches of 10: clipping, a StepLR;
    ``peek``: a first batch fetched before training, to look at (``next(iter(loader))``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    grads: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in model.parameters()]))
    model, prepared_opt, loader = prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=10))
    iterations = 0
    if peek:
        next(iter(loader))
    for _epoch in range(2):
        for x, y in loader:
            iterations += 1
            prepared_opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            prepared_opt.step()
            sched.step()
    params = [p.detach().clone() for p in model.parameters()]
    return {"grads": grads, "iterations": iterations, "lr": sched.get_last_lr(), "params": params}


def _split(prepare: Loop, k: int = 2, peek: bool = False) -> tuple[dict[str, Any], list[str]]:
    fails: list[str] = []
    inst = install(
        {"memdoctor_config": 1, "accumulation_steps": k, "accumulation_split": "loader"},
        say=lambda _: None,
        fail=fails.append,
    )
    try:
        got = _train(prepare, peek)
    finally:
        inst.remove()
    return got, fails


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["iterations"] == 2 * want["iterations"] == 12  # the body runs once per micro-batch
    assert len(got["grads"]) == len(want["grads"]) == 6 and got["lr"] == want["lr"]
    for g_step, w_step in zip(got["grads"], want["grads"], strict=True):
        for a, b in zip(g_step, w_step, strict=True):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
    for a, b in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def _plain(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[Any, Any, Any]:
    return model, opt, loader


@pytest.mark.parametrize(
    ("prepare", "peek"),
    [(_as_is, False), (_accelerate, False), (_as_is, True), (_accelerate, True), (_plain, True)],
    ids=["one_ahead", "accelerate", "one_ahead_peeked", "accelerate_peeked", "plain_peeked"],
)
def test_a_loader_read_ahead_defers_the_step_to_the_trained_last_micro_batch(
    prepare: Loop, peek: bool
) -> None:
    """Also after a batch peeked at before training: the look-ahead is the training iterator's."""
    want = _train(prepare, peek)
    got, fails = _split(prepare, peek=peek)
    assert fails == []
    _same(got, want)


def test_a_loader_read_two_ahead_stops_the_run_by_name() -> None:
    def two_ahead(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[Any, Any, Any]:
        return model, opt, OneAhead(loader, depth=2)

    _, fails = _split(two_ahead)
    assert fails and "read 2 batches ahead" in fails[0]


def test_accelerate_s_own_accumulation_stops_the_run_by_name() -> None:
    """accelerate steps every n-th ``accumulate()`` call: under a split it would step on micro-batches."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def accumulating(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[Any, Any, Any]:
        prepared: tuple[Any, Any, Any] = Accelerator(cpu=True, gradient_accumulation_steps=2).prepare(
            model, opt, loader
        )
        return prepared

    try:
        _, fails = _split(accumulating)
    finally:  # the next Accelerator starts from scratch
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert fails and "through accelerate (gradient_accumulation_steps=2)" in fails[0]


def test_profile_records_accelerate_s_own_accumulation() -> None:
    """Known before it is proposed: the loop facts say accelerate accumulates, and no loader split."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from memdoctor.capture.dataloader import DataCollector
    from memdoctor.capture.session import ProfileSession
    from memdoctor.plan.splits import split_of

    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[DataCollector()])
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    data = torch.utils.data.TensorDataset(torch.randn(60, 6), torch.randint(0, 3, (60,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with session:
            acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
            model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=10))
            for x, y in loader:
                with acc.accumulate(model):
                    acc.backward(nn.functional.cross_entropy(model(x), y))
                    opt.step()
                    opt.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    facts = [r["data"] for r in records if r["type"] == "collector" and r["name"] == "data"][-1]
    assert facts["loop"]["accelerate_accumulation"] == 2 and facts["lookahead"] == 1
    split = split_of(SimpleNamespace(collected={"data": facts}))
    assert split.kind is None and "through accelerate" in (split.why_not or "")
