"""The engine-aware ledger, collectives and link in one process: a plain script gets no new field, a
flat gradient buffer is counted once, the collectives' bytes and calls are what was called, and the
ranks' agreement before the link measurement never waits past its bound."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memdoctor.capture.link import agree
from memdoctor.capture.session import ProfileSession

pytestmark = pytest.mark.fast
CLASSIC = {"parameters", "gradients", "optimizer_state", "activations", "other"}


def _train(model: nn.Module, iterations: int, each=None) -> list[dict]:
    records: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ProfileSession(steps=iterations - 1, warmup=0, sink=records.append):
        for _ in range(iterations):
            model(torch.randn(4, 8)).sum().backward()
            if each is not None:
                each()
            opt.step()
    return records


def test_a_one_process_run_gets_no_engine_fields():
    records = _train(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), 3)
    steps = [r for r in records if r["type"] == "step"]
    assert steps
    for step in steps:
        assert "collectives" not in step
        assert set(step["memory"]["categories_at_peak"]) == CLASSIC
        assert "gradient_buckets" not in step["timeline"] and "sharding_buffers" not in step["timeline"]
        assert "sharding_buffer_bytes" not in step["modules"]["0"]
    names = {r["name"] for r in records if r["type"] == "collector"}
    assert not names & {"engines", "link"}


def test_gradients_viewing_one_flat_buffer_count_it_once():
    """Gradients made views into one padded flat buffer (as FSDP2's reduce-scatter output, or a
    trainer's contiguous gradient buffer): the buffer counts once, each module is charged its own
    gradients, and the padding goes to the first."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    flat = torch.zeros(sum(numels) + 5)  # 5 elements of padding
    views = flat[: sum(numels)].split(numels)
    for p, v in zip(params, views, strict=True):
        p.grad = v.view_as(p)
    records = _train(model, 2)
    step = next(r for r in records if r["type"] == "step")
    i = step["timeline"]["event"].index("opt_post")
    assert step["timeline"]["gradients"][i] == flat.untyped_storage().nbytes()
    grad_bytes = step["modules"]["0"]["grad_bytes"]
    assert grad_bytes[1] == (8 * 8 + 8 + 5) * 4 and grad_bytes[2] == (8 * 2 + 2) * 4
    assert sum(grad_bytes) == flat.untyped_storage().nbytes()


@pytest.fixture
def one_rank():
    """A gloo process group of one rank on an in-memory store, destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_are_counted_per_step_by_op(one_rank):
    t = torch.ones(16)  # 64 bytes

    def talk() -> None:
        dist.all_reduce(t)
        dist.all_gather_single(torch.empty(16), t)
        dist.all_reduce(t, async_op=True).wait()
        dist.all_gather_object([None], {"a": 1})  # two all_gathers inside (sizes, data), counted as such

    records = _train(nn.Linear(8, 2), 3, talk)
    steps = list({r["step"]: r for r in records if r["type"] == "step"}.values())  # the final records
    assert len(steps) == 2
    for step in steps:
        coll = step["collectives"]
        assert coll["by_op"]["all_reduce"]["calls"] == 2 and coll["by_op"]["all_reduce"]["bytes"] == 128
        assert coll["by_op"]["all_gather_single"]["calls"] == 1
        assert coll["by_op"]["all_gather_single"]["bytes"] == 64
        assert coll["by_op"]["all_gather"]["calls"] == 2 and "all_gather_object" not in coll["by_op"]
        assert coll["calls"] == 5 and coll["async_calls"] == 1 and coll["timing"] == "wall"
        assert coll["ms"] == pytest.approx(sum(r["ms"] for r in coll["by_op"].values()), abs=1e-3)
    # One rank has no link to measure.
    assert not [r for r in records if r["type"] == "collector" and r["name"] == "link"]


def test_the_link_agreement_skips_a_rank_that_never_comes():
    store = dist.HashStore()
    t0 = time.monotonic()
    assert agree(store, "k", world=2, wait_s=0.2) is False
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert agree(store, "k", world=2, wait_s=5.0) is False  # the late rank reads the decision at once
    assert time.monotonic() - t0 < 1.0


def test_the_link_agreement_goes_when_every_rank_arrives():
    store = dist.HashStore()
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(agree(store, "k", 3, 5.0))) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert answers == [True, True, True]


def test_a_step_reads_collectives_only_where_their_figures_are_numbers():
    from memdoctor.trace import StepRecord

    base = {"step": 0, "memory": {}, "modules": {}, "timeline": {}}
    good = {"ms": 1.5, "calls": 2, "bytes": 64, "by_op": {"all_reduce": {"ms": 1.5, "calls": 2, "bytes": 64}}}
    assert StepRecord.from_record({**base, "collectives": good}).collectives == good
    for bad in (
        {"ms": "1", "calls": 2, "bytes": 64},
        {**good, "by_op": {"x": {"ms": -1, "calls": 1, "bytes": 0}}},
        [],
    ):
        assert StepRecord.from_record({**base, "collectives": bad}).collectives is None
    assert StepRecord.from_record(base).collectives is None
    assert "collectives" not in StepRecord.from_record(base).to_record()
