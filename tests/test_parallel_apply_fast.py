"""``parallel``'s pieces that need no process group (``memdoctor.levers.parallel``, ``parallel_data``): the
rank's place from the launcher's environment, the refusals by name, the sampler each DataLoader gets
(or why not), the epochs of that sampler, and the refusal of a script's own group or DDP. The runs on
two ranks are in test_parallel_apply.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data.distributed import DistributedSampler

import memdoctor
from memdoctor.config import PlanConfig, parse_config
from memdoctor.errors import ConfigError
from memdoctor.levers.install import install
from memdoctor.levers.parallel import Parallel, World, refusals, refuse_own, world_of
from memdoctor.levers.parallel_data import DataSharding, EpochSampler, sampler_for

pytestmark = pytest.mark.fast

DATA = TensorDataset(torch.arange(10.0))
TWO = World(rank=0, local_rank=0, size=2)
FSDP2 = parse_config("memdoctor_config: 1\ngpus: 2\nparallel: fsdp2\n")
DDP = parse_config("memdoctor_config: 1\ngpus: 2\nparallel: ddp\n")


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def _no_seed() -> int:
    raise AssertionError("a sampler read in order needs no seed")


def test_the_rank_is_read_from_the_launchers_environment() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    assert world_of(env) == World(rank=3, local_rank=1, size=4)
    assert world_of({}) is None  # a process started alone
    assert world_of({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert world_of({"WORLD_SIZE": "two"}) is None


def test_what_cannot_apply_is_refused_by_name() -> None:
    assert refusals(FSDP2, TWO) == []
    assert refusals(PlanConfig(), None) == []  # no parallel: nothing to refuse
    alone = refusals(FSDP2, None)
    assert alone == [
        "parallel: fsdp2 needs 2 processes, and this is one (WORLD_SIZE is not set): "
        "run it with memdoctor run --nproc-per-node 2"
    ]
    # The file refuses ddp with full_offload already; a PlanConfig built in code is held to it too.
    both = dataclasses.replace(DDP, full_offload=True, shard_modules=("blocks.0",))
    found = refusals(both, TWO)
    assert any(r.startswith("parallel: ddp with full_offload") for r in found)
    assert any(r.startswith("parallel: ddp with shard_modules") for r in found)
    offload = dataclasses.replace(FSDP2, offload_parameters=("blocks.0",))
    assert refusals(offload, TWO)[0].startswith("parallel: fsdp2 with offload_parameters")
    assert all("\n" not in r for r in [*alone, *found])


def test_install_in_one_process_stops_on_the_first_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"needs 2 processes.*--nproc-per-node 2"):
        install(FSDP2, say=lambda line: None)
    assert not dist.is_initialized()


def test_apply_in_one_process_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"memdoctor\.apply cannot apply: parallel: ddp needs 2 processes"):
        memdoctor.apply(DDP, model)


def _args(**kwargs: Any) -> dict[str, Any]:
    return {"dataset": DATA, "batch_size": 2, **kwargs}


def test_a_loader_in_order_gets_a_distributed_sampler_in_order() -> None:
    for args in (_args(), _args(shuffle=False), _args(sampler=SequentialSampler(DATA))):
        found = sampler_for(args, 1, 2, _no_seed)
        assert isinstance(found, EpochSampler)
        assert (found.num_replicas, found.rank, found.shuffle) == (2, 1, False)
        assert list(found) == [1, 3, 5, 7, 9]


def test_a_shuffled_loader_gets_a_shuffling_one_with_the_shared_seed() -> None:
    for args in (_args(shuffle=True), _args(sampler=RandomSampler(DATA))):
        found = sampler_for(args, 0, 2, lambda: 7)
        assert isinstance(found, EpochSampler)
        assert (found.shuffle, found.seed) == (True, 7)


def test_what_cannot_be_sharded_says_why() -> None:
    own = BatchSampler(SequentialSampler(DATA), 2, drop_last=False)
    cases = {
        "IterableDataset (Stream)": _args(dataset=Stream()),
        "batch_sampler of the script's (BatchSampler)": _args(batch_sampler=own, batch_size=None),
        "sampler of the script's (RandomSampler)": _args(sampler=RandomSampler(DATA, replacement=True)),
        "sampler of the script's (WeightedRandomSampler)": _args(
            sampler=torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)
        ),
    }
    for why, args in cases.items():
        found = sampler_for(args, 0, 2, _no_seed)
        assert isinstance(found, str) and why in found, found
    mine = DistributedSampler(DATA, num_replicas=2, rank=0)
    assert sampler_for(_args(sampler=mine), 0, 2, _no_seed) is mine  # already sharded: kept


def test_the_ranks_read_disjoint_shares_reshuffled_every_epoch() -> None:
    ranks = [EpochSampler(DATA, num_replicas=2, rank=r, shuffle=True, seed=3) for r in (0, 1)]
    epochs = [[list(s) for s in ranks] for _ in range(3)]
    for shares in epochs:
        assert sorted(shares[0] + shares[1]) == list(range(10))  # together, every sample once
    assert epochs[0][0] != epochs[1][0]  # set_epoch was called: the next epoch reads another order
    assert [s.epoch for s in ranks] == [3, 3]


def test_the_script_s_data_loaders_are_sharded(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    sharding = DataSharding(1, 2, lines.append)
    undo = sharding.install()
    try:
        loader = DataLoader(DATA, batch_size=2)
        stream = DataLoader(Stream(), batch_size=2)
    finally:
        undo()
    # 5 samples of 10 a rank, in batches of 1/2 of the script's 2: the global batch stays 2
    assert isinstance(loader.sampler, EpochSampler) and loader.batch_size == 1 and len(loader) == 5
    assert [b[0].tolist() for b in loader] == [[1.0], [3.0], [5.0], [7.0], [9.0]]
    assert not isinstance(stream.sampler, DistributedSampler)
    assert lines == [
        "parallel: a DataLoader not sharded: it reads an IterableDataset (Stream), which yields its own "
        "samples; every rank reads the same batches (2 x the samples per step)"
    ]
    summary = sharding.summary()
    assert "DistributedSampler on 1 DataLoader(s): rank 1 read 1/2 of the samples" in summary
    assert "1 DataLoader(s) not sharded" in summary


def test_a_script_s_own_group_or_ddp_is_refused_by_name() -> None:
    said: list[str] = []

    class Stopped(Exception):
        pass

    def fail(message: str) -> None:
        said.append(message)
        raise Stopped

    undo = refuse_own(fail)
    try:
        with pytest.raises(Stopped):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(Stopped):
            torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    finally:
        undo()
    assert not dist.is_initialized()
    assert said[0].startswith("parallel: the script starts its own process group")
    assert said[1].startswith("parallel: the script wraps its model in DistributedDataParallel itself")


def test_a_shard_module_the_model_lacks_is_named_before_any_collective() -> None:
    cfg = parse_config("memdoctor_config: 1\ngpus: 2\nparallel: fsdp2\nshard_modules: [blocks.9]\n")
    lever = Parallel(cfg, TWO, lambda root: True, lambda line: None, lambda message: None)
    with pytest.raises(ValueError, match=r"shard_modules: Sequential has no module 'blocks\.9'"):
        lever.wrap(nn.Sequential(nn.Linear(2, 2)))
    assert lever.model is None
