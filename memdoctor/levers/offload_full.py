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
must run before the script's optimizer takes the parameters. ``torch.optim.Optimizer.__init__`` is
wrapped (``memdoctor.patching``): the first optimizer built over a model's parameters finds that model
(the root module owning them, as ``memdoctor.levers.targets`` does), shards it (each block of a repeated
stack, else each top-level child, then the root), and is built over the sharded parameters instead. A
script that steps a model whose optimizer was built before memdoctor was installed cannot be changed.

With world size 1 FSDP2 needs a process group; one is made in memory (``HashStore``: no port, no file),
gloo for the CPU and NCCL for CUDA, and destroyed at exit. A script that already runs one with more
than one process is refused: this lever is for one device.
"""

from __future__ import annotations

import atexit
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.capture.discovery import find_trained_roots
from memdoctor.levers.modnames import class_name, recorded_names
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


def not_sharded(root: nn.Module) -> str:
    """Why the model the plan applies to was found unsharded."""
    return (
        f"full_offload: {class_name(root)} was not sharded before its optimizer was built (the optimizer "
        "existed before memdoctor was installed, or was built over none of its parameters); FSDP2 must "
        "replace the parameters before an optimizer takes them"
    )


class FullOffload:
    """Shards the model of the first optimizer the script builds, before that optimizer takes its
    parameters. ``accept(root)``: whether ``root`` is the model the plan was made for; ``applied`` is
    told what was done, ``fail`` why it cannot be."""

    def __init__(
        self,
        accept: Callable[[nn.Module], bool],
        applied: Callable[[str], None],
        fail: Callable[[str], None],
        *,
        pin_memory: bool | None = None,
    ) -> None:
        self.accept = accept
        self.applied = applied
        self.fail = fail
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.model: nn.Module | None = None
        self._undo: list[Undo] = []

    def install(self) -> Undo:
        """Wrap ``Optimizer.__init__``; raises ValueError when this torch cannot shard at all."""
        found = fsdp2()
        if isinstance(found, str):
            raise ValueError(f"full_offload: {found}")
        original = torch.optim.Optimizer.__init__
        lever = self

        def __init__(opt: torch.optim.Optimizer, params: Any, *args: Any, **kwargs: Any) -> None:
            if lever.model is None:
                params = lever._before_optimizer(params)
            original(opt, params, *args, **kwargs)

        self._undo.append(set_attr(torch.optim.Optimizer, "__init__", __init__))
        return self.remove

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _before_optimizer(self, params: Any) -> Any:
        """The optimizer's ``params`` argument with the model's parameters replaced by its sharded ones
        (a generator is read once here and passed on as a list)."""
        if isinstance(params, torch.Tensor):
            return params  # not an iterable: the optimizer's own check refuses it
        params = list(params)
        ids = {id(p) for p in _tensors(params)}
        root = next((r for r in find_trained_roots(ids) if self.accept(r)), None)
        if root is None:
            return params
        try:
            swap = self.shard(root)
        except (RuntimeError, ValueError) as exc:
            self.fail(f"full_offload: FSDP2 could not shard {class_name(root)}: {exc}")
            return params
        return [_swapped(x, swap) for x in params]

    def shard(self, root: nn.Module) -> dict[int, nn.Parameter]:
        """Shard ``root`` with CPU offload; returns id(old parameter) -> its sharded parameter."""
        found = fsdp2()
        if isinstance(found, str):
            raise ValueError(f"full_offload: {found}")
        fully_shard, policy = found
        self._undo.append(process_group())
        before = {name: p for name, p in root.named_parameters(remove_duplicate=False)}
        units = shard_units(root)
        offload = policy(pin_memory=self.pin_memory)
        for unit in units:
            fully_shard(unit, offload_policy=offload)
        fully_shard(root, offload_policy=offload)
        self.model = root
        after = dict(root.named_parameters(remove_duplicate=False))
        swap = {id(p): after[name] for name, p in before.items() if name in after}
        self._undo.append(_kept_on_host(root, self.fail))
        self.applied(
            f"full_offload: {class_name(root)} sharded with FSDP2 fully_shard + CPUOffloadPolicy on one "
            f"process ({len(units)} units and the root; parameters, gradients and optimizer state on the "
            f"host, {_gib(dict(root.named_parameters()).values())} GiB), the optimizer built over the "
            "sharded parameters"
        )
        return swap

    def shard_built(self, root: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """For ``memdoctor.apply``, where the script already built its optimizer: shard ``root`` and
        put the sharded parameters in the optimizer's groups, in place (its state is made at its first
        step, keyed by the parameters it holds then). Refused once it has stepped: its state belongs to
        the parameters FSDP2 replaced."""
        if optimizer is not None and optimizer.state:
            raise ValueError(
                "full_offload: the optimizer has already stepped; apply the plan before the first step"
            )
        swap = self.shard(root)
        for group in optimizer.param_groups if optimizer is not None else []:
            params = group["params"]
            params[:] = [swap.get(id(p), p) for p in params]  # in place: LBFGS keeps this list


def _tensors(params: list[Any]) -> Iterable[torch.Tensor]:
    """The tensors of an optimizer's ``params``: tensors, ``(name, tensor)`` pairs (torch >= 2.6 takes
    ``named_parameters()``) and param groups of either (a group's ``params`` may be one tensor)."""
    for x in params:
        if isinstance(x, dict):
            group = x.get("params")
            yield from _tensors([group] if isinstance(group, torch.Tensor) else list(group or []))
        elif isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
            yield x[1]
        elif isinstance(x, torch.Tensor):
            yield x


def _swapped(x: Any, swap: dict[int, nn.Parameter]) -> Any:
    """One element of the optimizer's ``params`` (as ``_tensors`` reads it), with sharded parameters."""
    if isinstance(x, dict):
        group = dict(x)
        found = group.get("params")
        found = [found] if isinstance(found, torch.Tensor) else list(found or [])
        group["params"] = [_swapped(p, swap) for p in found]
        return group
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
        return (x[0], swap.get(id(x[1]), x[1]))
    return swap.get(id(x), x) if isinstance(x, torch.Tensor) else x


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
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def destroy() -> None:
        atexit.unregister(destroy)
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
    return destroy


def _kept_on_host(root: nn.Module, fail: Callable[[str], None]) -> Undo:
    """``model.to(device)`` / ``.cuda()`` after sharding (a script that moves the model after building
    its optimizer): FSDP2 already runs the model on the device and keeps its parameters on the host, so
    a move is a no-op; a change of dtype cannot apply to sharded parameters and stops the run."""
    undo: list[Undo] = []

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        dtypes = [a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        if any(p.dtype != d for d in dtypes for p in self.parameters()):
            fail(f"full_offload: the script casts the sharded model to {dtypes[0]}; cast it before")
        return self

    def cuda(self: nn.Module, device: Any = None) -> nn.Module:
        return self

    for name, fn in (("to", to), ("cuda", cuda)):
        undo.append(set_attr(root, name, types.MethodType(fn, root)))

    def remove() -> None:
        while undo:
            undo.pop()()

    return remove
