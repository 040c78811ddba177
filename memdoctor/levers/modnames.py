"""A live model's module names as a trace and a config hold them (``memdoctor.units.fit_name``).

Capture records a module name longer than the reader's limit cut (its start and a hash), so a plan made
from such a trace names the module that way. Every lever that matches a config's module names against
the live model goes through here, so that the same name is cut the same way on both sides.
"""

from __future__ import annotations

from torch import nn

from memdoctor.units import fit_name


def recorded_names(root: nn.Module) -> list[str]:
    """``root``'s module names, in ``named_modules()`` order, as the trace recorded them."""
    return [fit_name(name) for name, _ in root.named_modules()]


def submodule(root: nn.Module, name: str) -> nn.Module:
    """The module a config names: by its qualified name, or by the cut form of a long one."""
    if name == fit_name(name):
        try:
            return root.get_submodule(name)
        except AttributeError:
            pass
    for qual, module in root.named_modules():
        if fit_name(qual) == name:
            return module
    raise AttributeError(f"{type(root).__name__} has no module {name[:80]!r}")


def class_name(module: nn.Module) -> str:
    """The model's class as the script wrote it: FSDP2 swaps a sharded module's class for a subclass
    named ``FSDP<name>`` (bases: ``FSDPModule`` and the original)."""
    cls = type(module)
    bases = [b for b in cls.__bases__ if b.__name__ != "FSDPModule"]
    if cls.__name__.startswith("FSDP") and len(bases) < len(cls.__bases__) and bases:
        return bases[0].__name__
    return cls.__name__
