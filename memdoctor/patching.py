"""The one patch-and-undo primitive: every attribute memdoctor replaces goes through here.

A patch returns its undo. For a class or a module (``torch.Tensor.to``, ``torch.autograd.backward``,
the DataLoader iterator's ``__next__``), the undo puts the original back only while the attribute is
still ours (our value is still the one installed): if someone patched over us afterwards, their patch
stays and ours, under it, is left in the chain (a wrapper of ours then passes calls through), because
clobbering theirs would silently drop their behaviour for every later user. ``installed()`` lists those
patches not yet undone, so a leak check reads exactly what memdoctor has replaced instead of a hand-kept
list of targets.

A patch of one instance (a model's ``forward``, an optimizer's ``step``) is put back exactly, whatever
was set over it: what wraps an instance's attribute after us wraps our function for that object (an LR
scheduler rebinds the optimizer's ``step`` it finds, ours), so leaving it would keep calling ours after
the undo. It is not listed either: it dies with its instance, and a global list would keep it alive.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Undo = Callable[[], None]
_MISSING = object()
_INSTALLED: list[Patch] = []


@dataclass(eq=False)
class Patch:
    """``owner.name`` set to ``value``; ``previous`` is what ``vars(owner)`` held (``_MISSING``: nothing,
    the attribute was inherited or absent, so the undo deletes ours instead of setting a copy)."""

    owner: Any
    name: str
    value: Any
    previous: Any
    active: bool = True

    def is_ours(self) -> bool:
        """Our value is still the one installed (nobody patched over it)."""
        return vars(self.owner).get(self.name, _MISSING) is self.value

    def is_global(self) -> bool:
        """On a class or a module, so every later user sees it (an instance's patch dies with it)."""
        return isinstance(self.owner, (type, types.ModuleType))

    def where(self) -> str:
        """``torch.Tensor.to``, ``torch.tensor``: the dotted name of the patched attribute."""
        owner = self.owner
        if isinstance(owner, types.ModuleType):
            return f"{owner.__name__}.{self.name}"
        if isinstance(owner, type):
            return f"{owner.__module__}.{owner.__qualname__}.{self.name}"
        return f"{type(owner).__qualname__} instance.{self.name}"

    def undo(self) -> None:
        """Put the original back (on a class or module: only while still ours). Safe to call twice."""
        if not self.active:
            return
        self.active = False
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        if self.is_global() and not self.is_ours():
            return
        if self.previous is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)


def installed() -> list[Patch]:
    """The class and module patches installed and not yet undone, oldest first (undo newest first)."""
    return list(_INSTALLED)


def set_attr(owner: Any, name: str, value: Any) -> Undo:
    """``setattr(owner, name, value)``; the undo restores the previous value (see the module's rules)."""
    patch = Patch(owner, name, value, vars(owner).get(name, _MISSING))
    setattr(owner, name, value)
    if patch.is_global():
        _INSTALLED.append(patch)
    return patch.undo


def wrap_attr(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> Undo:
    """Replace ``owner.name`` (its own or inherited) by ``make(original)``, which keeps the original's
    name and docstring (``functools.wraps``), so the wrapper reads like the function it wraps."""
    original = getattr(owner, name)
    return set_attr(owner, name, functools.wraps(original)(make(original)))


def wrap_forward(module: Any, wrapper: Callable[..., Any]) -> Undo:
    """Make ``module(...)`` call ``wrapper(inner, *args, **kwargs)``, ``inner`` being its current forward.

    An instance attribute, which ``nn.Module.__call__`` finds before the class's ``forward`` (the way
    ``memdoctor.levers.apply.checkpoint_module`` wraps through it); wrappers stack, the last one outermost.
    """

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return wrapper(inner, *args, **kwargs)

        return forward

    return wrap_attr(module, "forward", make)
