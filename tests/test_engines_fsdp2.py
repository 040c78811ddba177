"""FSDP2 (``fully_shard``) on two gloo ranks: each rank's hook ledger equals what its tensors hold,
parameters, gradients and optimizer state at their local shard size, the gathered and reduce buffers
as ``sharding_buffers`` charged to the module they belong to, the gathered weights autograd saves not
counted as activations, and the all-gathers and reduce-scatters in each step's ``collectives``
(``tests/engines_worker.py`` runs the ranks)."""

from __future__ import annotations

import pytest
import torch
from engines_worker import STEPS, WARMUP, WATCHED, Net, launch, load

from memdoctor.capture.session import ProfileSession


def _plain_activations() -> int:
    """What the same model saves for backward in one plain process, at its forward's end."""
    records: list[dict] = []
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ProfileSession(steps=1, warmup=0, sink=records.append):
        for _ in range(2):
            net(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    tl = next(r for r in records if r["type"] == "step")["timeline"]
    return tl["activations"][_samples(tl, "fwd_post", "depth", 0)[0]]


def _samples(tl: dict, event: str, column: str, value: int) -> list[int]:
    """The timeline samples of ``event`` whose ``column`` is ``value``."""
    pairs = zip(tl["event"], tl[column], strict=True)
    return [i for i, (e, v) in enumerate(pairs) if e == event and v == value]


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_ledger_equals_the_tensors(tmp_path, reshard):
    launch(tmp_path, "fsdp2", reshard)
    plain = _plain_activations()
    for rank in (0, 1):
        trace, truth = load(tmp_path, rank)
        assert len(trace.steps) == WARMUP + STEPS
        model = trace.models[0]
        watched = model.names.index(WATCHED)
        groups = trace.collected["engines"]["fsdp"]
        sharded = {g["module"]: g["sharded_bytes"] for g in groups}
        assert set(sharded) == {0} | {model.names.index(f"blocks.{i}") for i in range(3)}
        for step in trace.steps:
            held = truth["steps"][step.step]
            tl = step.timeline
            end = tl["event"].index("opt_post")
            assert tl["parameters"][end] == held["parameters"] == sum(sharded.values())
            assert tl["gradients"][end] == held["gradient_storages"]
            assert tl["optimizer_state"][end] == held["optimizer_state"]
            assert tl["sharding_buffers"][end] == 0  # all resharded, the reduce-scatter inputs let go
            at = _samples(tl, "fwd_post", "module", watched)
            assert [tl["sharding_buffers"][i] for i in at] == [truth["forward"][step.step]]
            assert truth["forward"][step.step] > 0
            # The gathered weights autograd saves are not activations: as many as in one plain process.
            assert tl["activations"][_samples(tl, "fwd_post", "depth", 0)[0]] == plain
            _assert_collectives(step.collectives, sharded, groups, reshard)
        for step in trace.steps[WARMUP:]:  # the modules are known from the first optimizer step on
            cats = step.memory["categories_at_peak"]
            assert cats["sharding_buffers"] > 0  # the peak is in forward or backward, gathered
            assert step.memory["accounted_bytes"] == sum(v for k, v in cats.items() if k != "other")
            col = step.modules[0]["sharding_buffer_bytes"]
            assert all(col[m] >= 2 * sharded[m] for m in sharded)  # gathered: the world's shards
            assert sum(col) == sum(col[m] for m in sharded)
        assert trace.collected["link"]["measured"] is True


def _assert_collectives(coll: dict, sharded: dict[int, int], groups: list[dict], reshard: bool) -> None:
    """One all-gather per module a forward, again in backward where resharded (not the root's, kept
    gathered); one reduce-scatter per module; each the size of the unsharded (padded) parameters."""
    gathered = {m: 2 * n for m, n in sharded.items()}
    again = [g["module"] for g in groups if g["reshard_after_forward"]]
    assert (0 in again) is False and (len(again) == 3) is reshard
    ag, rs = coll["by_op"]["all_gather_single"], coll["by_op"]["reduce_scatter_single"]
    assert ag["calls"] == 4 + len(again)
    assert ag["bytes"] == sum(gathered.values()) + sum(gathered[m] for m in again)
    assert rs["calls"] == 4 and rs["bytes"] == sum(gathered.values())
    assert coll["calls"] == ag["calls"] + rs["calls"] and coll["bytes"] == ag["bytes"] + rs["bytes"]
    assert coll["ms"] > 0 and coll["timing"] == "wall" and coll["async_calls"] == 0
