"""``parallel``'s data side: every DataLoader the script builds, in each rank, is given torch's
``DistributedSampler``, so the ranks read disjoint shares of the dataset (rank K the samples K, K+N, ...
of the order the script's loader would read), each in batches of 1/N of the script's size, so that the
step's global batch, the steps of an epoch and the optimizer's trajectory are the script's (what the
planner predicts for ``--gpus N``: ``memdoctor.plan``'s per-rank batch is the batch / N). A batch size N
does not divide is kept, and said: the global batch is then N x the script's.

A built DataLoader cannot be changed, so ``DataLoader.__init__`` is wrapped before the script runs (as
``memdoctor.levers.loader`` does for ``data_loader``). The script's order is kept: ``shuffle=True`` (or a
plain ``RandomSampler``) becomes a shuffling ``DistributedSampler``, reshuffled every epoch (its
``set_epoch`` is called each time the loader starts an epoch: a one-process script never calls it), with
one seed on every rank (rank 0's, sent to the others: each rank's own draw would make the shares
overlap); otherwise the sampler reads in order. ``DistributedSampler`` pads the last share with samples
from the start so that every rank makes the same number of steps (a rank with one batch fewer would wait
forever in the others' collective).

What cannot be sharded is said by name, once per loader (``sampler_for``): an ``IterableDataset`` (it
yields its own samples), a ``batch_sampler`` or a sampler of the script's own (its order is the
script's logic). Every rank then reads the same batches: N times the samples per step, the same
gradients averaged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from memdoctor.patching import Undo, set_attr


class EpochSampler(DistributedSampler[Any]):
    """A ``DistributedSampler`` that moves to its next epoch each time an epoch starts (``set_epoch``)."""

    def __iter__(self) -> Iterator[Any]:
        order = super().__iter__()  # drawn now, with this epoch's seed
        self.set_epoch(self.epoch + 1)
        return order


def sampler_for(
    arguments: dict[str, Any], rank: int, size: int, seed: Callable[[], int]
) -> DistributedSampler[Any] | str:
    """The ``DistributedSampler`` for a DataLoader built with ``arguments`` (its ``__init__``'s, bound),
    or why it cannot have one (a string). ``seed()`` is called only for a shuffling one."""
    dataset = arguments.get("dataset")
    sampler = arguments.get("sampler")
    if isinstance(dataset, IterableDataset):
        return f"it reads an IterableDataset ({type(dataset).__name__}), which yields its own samples"
    if not hasattr(dataset, "__len__"):
        return f"it reads a dataset without a length ({type(dataset).__name__})"
    if arguments.get("batch_sampler") is not None:
        return f"it has a batch_sampler of the script's ({type(arguments['batch_sampler']).__name__})"
    if isinstance(sampler, DistributedSampler):
        return sampler
    if sampler is None:
        shuffle = bool(arguments.get("shuffle"))
    elif type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is RandomSampler and not sampler.replacement and _whole(sampler):
        shuffle = True
    else:
        return f"it has a sampler of the script's ({type(sampler).__name__})"
    data = cast("Dataset[Any]", dataset)
    return EpochSampler(data, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed() if shuffle else 0)


def _whole(sampler: RandomSampler) -> bool:
    """Whether a RandomSampler draws each sample once (not a ``num_samples`` of its own)."""
    try:
        return sampler.num_samples == len(sampler.data_source)
    except TypeError:  # a dataset without a length
        return False


def shared_seed(generator: torch.Generator | None) -> int:
    """Rank 0's seed for a shuffled order, on every rank: its loader's generator's, else torch's."""
    mine = generator.initial_seed() if generator is not None else torch.initial_seed()
    seed = torch.tensor([mine % 2**63], dtype=torch.int64)
    if dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())


class DataSharding:
    """The ``DataLoader.__init__`` wrapper (the module docstring) and what it did, for the end of the run."""

    def __init__(self, rank: int, size: int, say: Callable[[str], None]) -> None:
        self.rank, self.size, self.say = rank, size, say
        self.sharded = 0
        self.whole: list[str] = []  # why each loader that could not be sharded could not
        self.kept: list[Any] = []  # batch sizes the ranks could not divide

    def install(self) -> Undo:
        original = DataLoader.__init__
        signature = inspect.signature(original)
        patch = self

        def __init__(loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(loader, *args, **kwargs)
            patch._shard(bound.arguments)
            original(loader, *bound.args[1:], **bound.kwargs)

        return set_attr(DataLoader, "__init__", __init__)

    def _shard(self, arguments: dict[str, Any]) -> None:
        generator = arguments.get("generator")
        found = sampler_for(arguments, self.rank, self.size, lambda: shared_seed(generator))
        if isinstance(found, str):
            self.whole.append(found)
            self.say(f"parallel: a DataLoader not sharded: {found}; {self.same_batches()}")
            return
        arguments["sampler"] = found
        arguments["shuffle"] = None  # the sampler shuffles; DataLoader refuses both
        batch = arguments.get("batch_size", 1)
        if isinstance(batch, int) and batch % self.size == 0:
            arguments["batch_size"] = batch // self.size
        else:
            self.kept.append(batch)
            self.say(
                f"parallel: a DataLoader's batch size {batch} is not divisible by {self.size} ranks: kept, "
                f"so the global batch is {self.size} x the script's"
            )
        self.sharded += 1

    def same_batches(self) -> str:
        return f"every rank reads the same batches ({self.size} x the samples per step)"

    def summary(self) -> str:
        """The end-of-run line."""
        if not self.sharded and not self.whole:
            return "parallel: NOT applied to the data: the script built no DataLoader to shard"
        parts = []
        if self.sharded:
            read = f"DistributedSampler on {self.sharded} DataLoader(s): rank {self.rank} read 1/{self.size}"
            kept = f"; batch sizes {self.kept} kept (a global batch {self.size} x the script's)"
            whole = f", in batches of 1/{self.size} of the script's (the global batch is the script's)"
            parts.append(f"{read} of the samples" + (kept if self.kept else whole))
        if self.whole:
            whole = f"{len(self.whole)} DataLoader(s) not sharded ({self.whole[0]})"
            parts.append(f"{whole}: {self.same_batches()}")
        return "parallel: " + "; ".join(parts)
