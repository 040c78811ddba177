"""One patch of ``torch.autograd.backward``: where loss scaling and micro-batching meet the user's loss.

``loss.backward()`` (and ``accelerator.backward(loss)``, which calls it) goes through
``torch.autograd.backward``, looked up on the module at each call. torch has no hook that runs before a
backward starts, so the function is replaced for the run (and put back by the undo). Only the user's
own backward of a scalar loss is touched: calls made while a backward runs (reentrant checkpointing)
and calls with explicit gradients pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memdoctor import patching

Scale = Callable[[torch.Tensor], torch.Tensor]


class BackwardPatch:
    """``share`` (a loop split's micro-batch weight, ``memdoctor.levers.loopsplit``), then ``scale``
    (fp16 loss scaling), are applied to the user's scalar loss; ``after`` callbacks run when the user's
    backward has finished (micro-batching adds its deferred gradients there)."""

    def __init__(self) -> None:
        self.share: Scale | None = None
        self.scale: Scale | None = None
        self.after: list[Callable[[], None]] = []
        self.raw: Callable[..., Any] = torch.autograd.backward
        self._depth = 0

    def install(self) -> Callable[[], None]:
        self.raw = torch.autograd.backward
        return patching.set_attr(torch.autograd, "backward", self._backward)

    def _backward(self, tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        user = self._depth == 0 and grad_tensors is None and _scalar(tensors)
        if user and self.share is not None:
            tensors = self.share(tensors if isinstance(tensors, torch.Tensor) else tensors[0])
        if user and self.scale is not None:
            tensors = self.scale(tensors if isinstance(tensors, torch.Tensor) else tensors[0])
        self._depth += 1
        try:
            result = self.raw(tensors, grad_tensors, *args, **kwargs)
        finally:
            self._depth -= 1
        if user:
            for callback in self.after:
                callback()
        return result


def _scalar(tensors: Any) -> bool:
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
        tensors = tensors[0]
    return isinstance(tensors, torch.Tensor) and tensors.numel() == 1
