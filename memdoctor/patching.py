"""Small reversible patches: each returns its undo, so an installer can put everything back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

Undo = Callable[[], None]


def wrap_forward(module: nn.Module, wrapper: Callable[..., Any]) -> Undo:
    """Make ``module(...)`` call ``wrapper(inner, *args, **kwargs)``, ``inner`` being its current forward.

    An instance attribute, which ``nn.Module.__call__`` finds before the class's ``forward`` (the way
    ``memdoctor.levers.apply.checkpoint_module`` wraps through it); wrappers stack, the last one outermost.
    """
    previous = module.__dict__.get("forward")
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapper(inner, *args, **kwargs)

    module.forward = forward

    def undo() -> None:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous

    return undo


def set_attr(owner: Any, name: str, value: Any) -> Undo:
    """``setattr(owner, name, value)``, undone by putting the previous value back exactly."""
    had = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, value)

    def undo() -> None:
        if had:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)

    return undo
