"""Full offload (``full_offload: true``): parameters, gradients and optimizer state in host memory, through
torch's own engine, FSDP2 ``fully_shard`` with ``CPUOffloadPolicy``, in the script's one process.

Why FSDP2 and not our own hooks (``memdoctor.levers.offload`` moves chosen modules' parameters and the
optimizer state): when the parameters and gradients alone exceed the card, every block's parameters
must come in just before it runs and leave after, both in forward and backward, with the next block's
copy prefetched while this one computes, and each gradient must leave as soon as it is made. FSDP2 does
exactly that per ``fully_shard`` unit, and its CPU offload keeps the sharded parameters, the gradients
and the optimizer's state on the host, where the script's own optimizer steps them. (DeepSpeed
ZeRO-Offload does the same, but needs DeepSpeed and a DeepSpeed engine the script does not build.)

How it reaches an unmodified script: FSDP2 replaces each parameter by a new ``DTensor`` parameter, so it
must run before the script's optimizer takes the parameters: inside the first ``Optimizer.__init__``
over the model's parameters (``memdoctor.levers.beforeoptimizer``, shared with ``parallel``), each block
of a repeated stack, else each top-level child, then the root is sharded, and the optimizer is built
over the sharded parameters instead.

With world size 1 FSDP2 needs a process group; one is made in memory (``HashStore``: no port, no file),
gloo for the CPU and NCCL for CUDA, and destroyed at exit. A script that already runs one with more
than one process is refused: this lever is for one device.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.levers.beforeoptimizer import BeforeOptimizer, Swap, swap_of
from memdoctor.levers.modnames import class_name, recorded_names
from memdoctor.levers.owngroup import start_own_group
from memdoctor.patching import Undo, set_attr

STACK_MIN = 3  # as the analysis's repeated stacks (memdoctor.analysis.layers.repeated_blocks)


def fsdp2() -> tuple[Callable[..., Any], type] | str:
    """``(fully_shard, CPUOffloadPolicy)`` of this torch, or why it has none. The public API is
    ``torch.distributed.fsdp`` since torch 2.6; 2.4-2.5 had it under ``_composable`` (private, so
    only behind this check)."""
    if not dist.is_available():
        return "this torch was built without torch.distributed"
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        return fully_shard, CPUOffloadPolicy
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard

        return fully_shard, CPUOffloadPolicy
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 (fully_shard with CPUOffloadPolicy: torch >= 2.4)"


def shard_units(root: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one before the root: each member of a stack of ``STACK_MIN`` or more
    sibling blocks of one class holding parameters (a transformer's blocks), outermost stacks only;
    without a stack, each top-level child holding parameters. A module whose parameters are also held
    outside it (a tied embedding and LM head) is left to the root's unit, which holds both."""
    owners: dict[int, int] = {}
    for module in root.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    units = _stacks(root) or [c for c in root.children() if _holds(c)]
    return [u for u in units if not _tied(u, owners)]


def _holds(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stacks(root: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    todo = [root]
    while todo:
        node = todo.pop(0)
        by_type: dict[type, list[nn.Module]] = {}
        for child in node.children():
            if _holds(child):
                by_type.setdefault(type(child), []).append(child)
        stacks = [g for g in by_type.values() if len(g) >= STACK_MIN and _is_block(g[0])]
        taken = {id(m) for group in stacks for m in group}
        found += [c for c in node.children() if id(c) in taken]
        todo += [c for c in node.children() if id(c) not in taken]
    return found


def _is_block(module: nn.Module) -> bool:
    """A module with children: a stack of leaf layers (an MLP's Linears) is not sharded layer by layer
    (FSDP2 units that small cost a copy each, and an in-place op on a unit's output, a ``ReLU(inplace)``
    after a ``Linear``, would skip FSDP2's backward hook)."""
    return any(True for _ in module.children())


def _tied(unit: nn.Module, owners: dict[int, int]) -> bool:
    """Whether a parameter of ``unit`` is also registered outside it."""
    inside: dict[int, int] = {}
    for module in unit.modules():
        for p in module.parameters(recurse=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
    return any(owners[i] > n for i, n in inside.items())


def model_for(names: Iterable[str]) -> Callable[[nn.Module], bool]:
    """Which root to shard: the first that holds every module the config names, as the installer's
    model watch takes it (``memdoctor.levers.install``: another class with those modules is noted,
    not refused)."""
    wanted = list(names)

    def accept(root: nn.Module) -> bool:
        held = set(recorded_names(root))
        return all(n in held for n in wanted)

    return accept


class FullOffload(BeforeOptimizer):
    """Shards the model of the first optimizer the script builds with FSDP2 and ``CPUOffloadPolicy``,
    before that optimizer takes its parameters (``memdoctor.levers.beforeoptimizer``)."""

    part = "full_offload"

    def __init__(
        self,
        accept: Callable[[nn.Module], bool],
        applied: Callable[[str], None],
        fail: Callable[[str], None],
        *,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(accept, applied, fail)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def unavailable(self) -> str | None:
        found = fsdp2()
        return found if isinstance(found, str) else None

    def wrap(self, root: nn.Module) -> Swap:
        """Shard ``root`` with CPU offload; returns id(old parameter) -> its sharded parameter."""
        found = fsdp2()
        if isinstance(found, str):
            raise ValueError(f"full_offload: {found}")
        fully_shard, policy = found
        self._undo.append(process_group())
        before = dict(root.named_parameters(remove_duplicate=False))
        units = shard_units(root)
        offload = policy(pin_memory=self.pin_memory)
        for unit in units:
            fully_shard(unit, offload_policy=offload)
        fully_shard(root, offload_policy=offload)
        self.model = root
        self._undo.append(kept_on_device(root, self.fail, self.part))
        self.applied(
            f"full_offload: {class_name(root)} sharded with FSDP2 fully_shard + CPUOffloadPolicy on one "
            f"process ({len(units)} units and the root; parameters, gradients and optimizer state on the "
            f"host, {_gib(dict(root.named_parameters()).values())} GiB), the optimizer built over the "
            "sharded parameters"
        )
        return swap_of(root, before)


def _gib(params: Iterable[torch.Tensor]) -> str:
    return f"{sum(p.numel() * p.element_size() for p in params) / 2**30:.2f}"


def process_group() -> Undo:
    """A world of one process for FSDP2 (gloo, and NCCL for CUDA tensors), in memory; destroyed by the
    undo or at exit. An existing group is used when it has one process; one of more is refused."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                f"the script runs {dist.get_world_size()} processes; full_offload shards a model on one "
                "(for several, apply FSDP2 in the script itself)"
            )
        return lambda: None
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    return start_own_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def kept_on_device(root: nn.Module, fail: Callable[[str], None], part: str) -> Undo:
    """``model.to(device)`` / ``.cuda()`` after the engine wrapped ``root`` (a script that moves the model
    after building its optimizer): the engine already put it where it runs (FSDP2 on the device, or its
    parameters on the host with CPU offload; DDP on the rank's device), so a move is a no-op; a change of
    dtype cannot apply to wrapped parameters and stops the run."""
    undo: list[Undo] = []

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        dtypes = [a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        if any(p.dtype != d for d in dtypes for p in self.parameters()):
            fail(f"{part}: the script casts the wrapped model to {dtypes[0]}; cast it before")
        return self

    def cuda(self: nn.Module, device: Any = None) -> nn.Module:
        return self

    for name, fn in (("to", to), ("cuda", cuda)):
        undo.append(set_attr(root, name, types.MethodType(fn, root)))

    def remove() -> None:
        while undo:
            undo.pop()()

    return remove
