"""``parallel`` (``ddp``, ``fsdp2``, ``fsdp2-no-reshard``): an unmodified one-GPU script run as every rank of
``torch.distributed.run`` (``memdoctor run --nproc-per-node N``), spread over the ranks by torch's own
engines, DDP or FSDP2 ``fully_shard``.

Inside each rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` set by the launcher),
before the script runs (``start_parallel``):

- the default process group is started from that environment (gloo on a CPU; on CUDA, NCCL for CUDA
  tensors and gloo for CPU ones), and ``cuda`` made the rank's GPU (``torch.cuda.set_device(LOCAL_RANK)``),
  so a script's ``.to("cuda")`` / ``.cuda()`` lands on it;
- the script starting a group of its own (``init_process_group``) or wrapping a model in DDP itself is
  refused by name: the config was made for a one-process script, and a second wrap would double every
  gradient reduction;
- every DataLoader the script builds is given a ``DistributedSampler`` (``memdoctor.levers.parallel_data``);
- the model of the first optimizer the script builds is wrapped before that optimizer takes its
  parameters (``memdoctor.levers.beforeoptimizer``, as ``full_offload`` does): FSDP2 ``fully_shard`` on
  each of ``shard_modules``, then the root (``reshard_after_forward`` per the parallel value;
  ``CPUOffloadPolicy`` with ``full_offload``), after the parameters and buffers are broadcast from rank
  0 (FSDP2, unlike DDP, does not make the ranks' copies equal, and an unseeded script initialises each
  rank differently); or DDP, through which the script's own ``model(...)`` calls are routed (the
  script holds the model, not the DDP wrapper: its ``forward`` is redirected while the wrapper runs the
  original inside).

The script's optimizer steps are its own: one per batch on each rank; each rank's batch is the script's,
so the global batch is N times it, and an epoch over a sharded loader has 1/N of the steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from memdoctor.capture.engines import wrapped_by
from memdoctor.config import PlanConfig
from memdoctor.levers.beforeoptimizer import BeforeOptimizer, Swap, swap_of
from memdoctor.levers.modnames import class_name, submodule
from memdoctor.levers.offload_full import fsdp2, kept_on_device, model_for
from memdoctor.levers.owngroup import start_own_group
from memdoctor.levers.parallel_data import DataSharding
from memdoctor.patching import Undo, wrap_attr, wrap_forward
from memdoctor.units import format_bytes

FSDP2 = ("fsdp2", "fsdp2-no-reshard")


@dataclass(frozen=True)
class World:
    """This process's place in the job, as ``torch.distributed.run`` set it in the environment."""

    rank: int
    local_rank: int
    size: int

    def device(self) -> torch.device:
        """The rank's device: its GPU (``cuda:LOCAL_RANK``) where CUDA is, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def world_of(environ: Mapping[str, str]) -> World | None:
    """The rank, local rank and world size the launcher set; None in a process started alone."""
    try:
        size = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
        local = int(environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        return None
    return World(rank, local, size) if size > 1 else None


def refusals(config: PlanConfig, world: World | None) -> list[str]:
    """What of ``config``'s ``parallel`` cannot apply in this process (``world``: its place in the job,
    None when it was started alone), one sentence each (none: it can)."""
    p = config.parallel
    if p is None:
        return []
    out = []
    if not dist.is_available():
        out.append(f"parallel: {p}: this torch was built without torch.distributed")
    elif p in FSDP2 and isinstance(fsdp2(), str):
        out.append(f"parallel: {p}: {fsdp2()}")
    if world is None:
        out.append(
            f"parallel: {p} needs {config.gpus} processes, and this is one (WORLD_SIZE is not set): "
            f"run it with memdoctor run --nproc-per-node {config.gpus}"
        )
    if p == "ddp" and config.full_offload:
        out.append("parallel: ddp with full_offload: DDP keeps a whole replica per GPU; use fsdp2")
    if p == "ddp" and config.shard_modules:
        out.append("parallel: ddp with shard_modules: DDP shards nothing; use fsdp2, or drop shard_modules")
    if config.offload_parameters or config.optimizer == "offload":
        out.append(
            f"parallel: {p} with offload_parameters or optimizer: offload is not applied (with fsdp2, "
            "full_offload offloads through FSDP2's CPUOffloadPolicy)"
        )
    return out


class Parallel(BeforeOptimizer):
    """Wraps the model of the first optimizer the script builds in DDP or FSDP2 (the module docstring)."""

    def __init__(
        self,
        config: PlanConfig,
        world: World,
        accept: Callable[[nn.Module], bool],
        applied: Callable[[str], None],
        fail: Callable[[str], None],
    ) -> None:
        super().__init__(accept, applied, fail)
        self.config = config
        self.world = world
        self.part = f"parallel: {config.parallel}"
        self.ddp: nn.Module | None = None

    def unavailable(self) -> str | None:
        found = fsdp2() if self.config.parallel in FSDP2 else None
        return found if isinstance(found, str) else None

    def wrap(self, root: nn.Module) -> Swap:
        self._on_rank_device(root)
        swap = self._ddp(root) if self.config.parallel == "ddp" else self._fsdp2(root)
        self._undo.append(kept_on_device(root, self.fail, self.part))
        return swap

    def _on_rank_device(self, root: nn.Module) -> None:
        """A model put on another rank's GPU (the script wrote ``cuda:0``) cannot run here."""
        mine = self.world.device()
        for p in root.parameters():
            if p.device.type == "cuda" and p.device != mine:
                raise ValueError(
                    f"the script put it on {p.device}, and rank {self.world.rank}'s GPU is {mine}: write "
                    ".to('cuda') (memdoctor makes it each rank's GPU)"
                )

    def _fsdp2(self, root: nn.Module) -> Swap:
        found = fsdp2()
        if isinstance(found, str):
            raise ValueError(found)
        fully_shard, policy = found
        units = []
        for name in self.config.shard_modules:
            try:
                units.append(submodule(root, name))
            except AttributeError as exc:
                raise ValueError(f"shard_modules: {exc}") from None
        broadcast_states(root)
        reshard = self.config.parallel == "fsdp2"
        kwargs: dict[str, Any] = {"reshard_after_forward": reshard}
        if self.config.full_offload:
            kwargs["offload_policy"] = policy(pin_memory=torch.cuda.is_available())
        before = dict(root.named_parameters(remove_duplicate=False))
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(root, **kwargs)
        self.model = root
        host = "; parameters, gradients and optimizer state on the host" if self.config.full_offload else ""
        self.applied(
            f"{self.part}: {class_name(root)} sharded over {self.world.size} ranks with FSDP2 fully_shard "
            f"({len(units)} modules and the root, reshard_after_forward={reshard}{host}; "
            f"{format_bytes(_bytes(before.values()))} of parameters in all), rank {self.world.rank} on "
            f"{self.world.device()}, the optimizer built over its shard"
        )
        return swap_of(root, before)

    def _ddp(self, root: nn.Module) -> Swap:
        from torch.nn.parallel import DistributedDataParallel

        device = self.world.device()
        if device.type == "cuda":
            root.to(device)  # a model still on the host (moved after its optimizer, kept on the GPU here)
        ids = [device.index] if device.type == "cuda" else None
        with ours():
            ddp = DistributedDataParallel(root, device_ids=ids)
        self.ddp = ddp
        self._undo.append(wrapped_by(root, ddp))  # the profiler's ledger counts its buckets
        self._undo.append(routed_through(root, ddp))
        self.model = root
        self.applied(
            f"{self.part}: {class_name(root)} wrapped in DistributedDataParallel over {self.world.size} "
            f"ranks (a whole replica per rank, gradients averaged in buckets during backward), rank "
            f"{self.world.rank} on {device}; the script's model(...) calls run through it"
        )
        return {}


def routed_through(root: nn.Module, ddp: nn.Module) -> Undo:
    """Make the script's ``root(...)`` call ``ddp(...)``, which calls ``root`` back: that inner call runs
    ``root``'s own forward. (DDP prepares its gradient reduction in its own forward; a call of the bare
    model would skip it and leave each rank's gradients its own.) ``root``'s hooks run for both calls."""
    inside = [False]

    def forward(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            return inner(*args, **kwargs)
        inside[0] = True
        try:
            return ddp(*args, **kwargs)
        finally:
            inside[0] = False

    return wrap_forward(root, forward)


def broadcast_states(root: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, as DDP does when it wraps a model."""
    with torch.no_grad():
        for t in [*root.parameters(), *root.buffers()]:
            dist.broadcast(t.data, src=0)


_OURS = [False]  # set while memdoctor itself builds DDP


class ours:
    """While memdoctor builds the engine: the refusals of ``refuse_own`` let it through."""

    def __enter__(self) -> None:
        _OURS[0] = True

    def __exit__(self, *exc: object) -> None:
        _OURS[0] = False


def refuse_own(fail: Callable[[str], None]) -> Undo:
    """Stop a script that starts its own process group or wraps its model in DDP, by name."""
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel

    why = "the config was made for a one-process script, and memdoctor run starts and wraps it"

    def own_group(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            fail(
                "parallel: the script starts its own process group (torch.distributed.init_process_group): "
                f"{why}; remove parallel from the config to run the script's own"
            )
            return original(*args, **kwargs)

        return init_process_group

    def own_ddp(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            if not _OURS[0]:
                fail(
                    "parallel: the script wraps its model in DistributedDataParallel itself: "
                    f"{why}; remove parallel from the config to run the script's own"
                )
            original(self, *args, **kwargs)

        return __init__

    undo = [wrap_attr(m, "init_process_group", own_group) for m in (dist, distributed_c10d)]
    undo.append(wrap_attr(DistributedDataParallel, "__init__", own_ddp))

    def remove() -> None:
        while undo:
            undo.pop()()

    return remove


def start_group(world: World) -> Undo:
    """The default process group from the launcher's environment (``env://``), ``cuda`` made the rank's
    GPU first; destroyed by the undo or at exit. gloo on a CPU; on CUDA, NCCL for CUDA tensors and gloo
    for CPU ones (the DataLoader's seed, a model's host buffers)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    return start_own_group(backend, rank=world.rank, world_size=world.size)


def start_parallel(
    config: PlanConfig,
    applied: Callable[[str], None],
    fail: Callable[[str], None],
    environ: Mapping[str, str] | None = None,
) -> tuple[Parallel, DataSharding, list[Undo]] | None:
    """``memdoctor run``'s part (``memdoctor.levers.install``), before the script runs: the group, the
    refusals of the script's own, the DataLoader sharding and the model's wrap at its optimizer, with
    their undos in order. None when ``fail`` was told why it cannot apply."""
    world = world_of(os.environ if environ is None else environ)
    refused = refusals(config, world)
    if dist.is_available() and dist.is_initialized():
        refused.append("parallel: a process group exists before the script runs; memdoctor run starts it")
    if refused or world is None:
        fail(refused[0])
        return None
    undo = [start_group(world)]
    if world.size != config.gpus:
        applied(f"note: the config was planned for {config.gpus} GPUs; this job runs {world.size} ranks")
    undo.append(refuse_own(fail))
    sharding = DataSharding(world.rank, world.size, applied)
    undo.append(sharding.install())
    lever = Parallel(config, world, model_for(config.checkpoint), applied, fail)
    undo.append(lever.install())  # its torch was checked by ``refusals``
    return lever, sharding, undo


def apply_parallel(config: PlanConfig, model: nn.Module, optimizer: Any, loader: Any) -> list[Undo]:
    """``memdoctor.apply``'s part, in a rank of the user's own job: their group is used (else one is
    started from the launcher's environment) and the model wrapped in place (the optimizer, not stepped
    yet, made to hold FSDP2's parameters); a DataLoader given must already use a ``DistributedSampler``
    (a built one cannot take one). ValueError names what cannot apply. Neither engine can be undone: the
    undos end only the DDP routing and a group memdoctor started."""
    started = dist.is_available() and dist.is_initialized()
    if started:
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank))
        world: World | None = World(rank, local, dist.get_world_size())
    else:
        world = world_of(os.environ)
    refused = refusals(config, world)
    sampler = getattr(loader, "sampler", None)
    if loader is not None and not isinstance(sampler, DistributedSampler):
        refused.append(
            f"parallel: {config.parallel}: the DataLoader given was built without a DistributedSampler "
            "and cannot take one now; build it with sampler=DistributedSampler(dataset)"
        )
    if refused or world is None:
        raise ValueError(refused[0])
    undo = [] if started else [start_group(world)]

    def fail(message: str) -> None:
        raise ValueError(message)

    lever = Parallel(config, world, lambda root: True, lambda line: None, fail)
    try:
        lever.wrap_built(model, optimizer)
    except BaseException:
        while undo:
            undo.pop()()
        raise
    undo.append(lever.remove)
    return undo


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


__all__ = ["Parallel", "World", "apply_parallel", "refusals", "start_parallel", "world_of"]
