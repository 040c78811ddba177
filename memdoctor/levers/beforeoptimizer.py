"""Wrapping the script's model in one of torch's engines (FSDP2 ``fully_shard``, DDP) before its optimizer
takes the parameters: the common part of ``full_offload`` (``memdoctor.levers.offload_full``) and
``parallel`` (``memdoctor.levers.parallel``).

Why before: FSDP2 replaces each parameter by a new ``DTensor`` parameter, so an optimizer built over the
old ones would step tensors the model no longer uses; DDP keeps the parameters but must see the model
complete and on its device. The moment every training loop shares is the script building its optimizer
(HF Trainer, Lightning and accelerate build it with ``torch.optim`` too), so
``torch.optim.Optimizer.__init__`` is wrapped (``memdoctor.patching``): the first optimizer built over a
model's parameters finds that model (the root module owning them, as ``memdoctor.levers.targets`` does),
the engine wraps it, and the optimizer is built over the parameters the engine left instead. A model
whose optimizer was built before memdoctor was installed cannot be wrapped (``not_wrapped`` says so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.discovery import find_trained_roots
from memdoctor.levers.modnames import class_name
from memdoctor.patching import Undo, set_attr

Swap = dict[int, nn.Parameter]  # id(the script's parameter) -> the one the engine put in its place


class BeforeOptimizer:
    """Wraps the model of the first optimizer the script builds, before that optimizer takes its
    parameters. ``accept(root)``: whether ``root`` is the model the plan was made for; ``applied`` is
    told what was done, ``fail`` why it cannot be. Subclasses name their ``part`` and ``wrap`` a root."""

    part = "engine"  # the config part, first in every message

    def __init__(
        self,
        accept: Callable[[nn.Module], bool],
        applied: Callable[[str], None],
        fail: Callable[[str], None],
    ) -> None:
        self.accept = accept
        self.applied = applied
        self.fail = fail
        self.model: nn.Module | None = None
        self._undo: list[Undo] = []

    def unavailable(self) -> str | None:
        """Why this torch cannot apply the engine at all (None: it can)."""
        return None

    def wrap(self, root: nn.Module) -> Swap:
        """Apply the engine to ``root`` (set ``self.model``); returns the parameters it replaced.
        ValueError or RuntimeError: it cannot, and why."""
        raise NotImplementedError

    def install(self) -> Undo:
        """Wrap ``Optimizer.__init__``; raises ValueError when this torch cannot apply the engine."""
        why = self.unavailable()
        if why is not None:
            raise ValueError(f"{self.part}: {why}")
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

    def not_wrapped(self, root: nn.Module) -> str:
        """Why the model the plan applies to was found unwrapped."""
        return (
            f"{self.part}: {class_name(root)} was not wrapped before its optimizer was built (the "
            "optimizer existed before memdoctor was installed, was built over none of its parameters, or "
            "the script builds none); the engine must wrap the model before an optimizer takes its "
            "parameters"
        )

    def _before_optimizer(self, params: Any) -> Any:
        """The optimizer's ``params`` argument with the model's parameters replaced by the engine's (a
        generator is read once here and passed on as a list)."""
        if isinstance(params, torch.Tensor):
            return params  # not an iterable: the optimizer's own check refuses it
        params = list(params)
        ids = {id(p) for p in _tensors(params)}
        root = next((r for r in find_trained_roots(ids) if self.accept(r)), None)
        if root is None:
            return params
        try:
            swap = self.wrap(root)
        except (RuntimeError, ValueError) as exc:
            self.fail(f"{self.part}: could not wrap {class_name(root)}: {exc}")
            return params
        return [_swapped(x, swap) for x in params]

    def wrap_built(self, root: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """For ``memdoctor.apply``, where the script already built its optimizer: wrap ``root`` and put
        the new parameters in the optimizer's groups, in place (its state is made at its first step,
        keyed by the parameters it holds then). Refused once it has stepped: its state belongs to the
        parameters the engine replaced."""
        if optimizer is not None and optimizer.state:
            raise ValueError(f"{self.part}: the optimizer has already stepped; apply the plan before it")
        swap = self.wrap(root)
        for group in optimizer.param_groups if optimizer is not None else []:
            params = group["params"]
            params[:] = [swap.get(id(p), p) for p in params]  # in place: LBFGS keeps this list


def swap_of(root: nn.Module, before: dict[str, nn.Parameter]) -> Swap:
    """id(each parameter in ``before``, by name) -> ``root``'s parameter of that name now."""
    after = dict(root.named_parameters(remove_duplicate=False))
    return {id(p): after[name] for name, p in before.items() if name in after}


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


def _swapped(x: Any, swap: Swap) -> Any:
    """One element of the optimizer's ``params`` (as ``_tensors`` reads it), with the new parameters."""
    if isinstance(x, dict):
        group = dict(x)
        found = group.get("params")
        found = [found] if isinstance(found, torch.Tensor) else list(found or [])
        group["params"] = [_swapped(p, swap) for p in found]
        return group
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
        return (x[0], swap.get(id(x[1]), x[1]))
    return swap.get(id(x), x) if isinstance(x, torch.Tensor) else x
