"""The wrappers ``TransferCollector`` installs on ``torch.Tensor``'s copy methods and reads, and on
``torch.tensor`` / ``torch.as_tensor`` (``transfers.py`` says why these entry points).

Each wrapper first asks whether it is looking at a transfer at all (a dtype cast, a CPU tensor's
``.item()`` is not) and otherwise calls the original at once: the cost off the transfer path is a few
attribute reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.capture.transferlog import READS

if TYPE_CHECKING:
    from memdoctor.capture.transfers import TransferCollector

# Under torch.compile, dynamo traces into the wrappers: the first thing each does is this check (which
# dynamo understands), so a compiled region sees the original call and no bookkeeping to trace.
_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _wrap_to(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy():
            return orig(self, *args, **kwargs)
        target = _target(args, kwargs, accel)
        direction = _direction(self.device.type, target, accel) if target is not None else None
        if direction is None:
            return orig(self, *args, **kwargs)
        host = self if direction == "h2d" else None
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("to", direction, host, int(self.nbytes), nb, orig, (self, *args), kwargs)

    return to


def _wrap_cuda(col: TransferCollector, orig: Any, name: str) -> Any:
    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or self.device.type != "cpu":
            return orig(self, *args, **kwargs)
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("cuda", "h2d", self, int(self.nbytes), nb, orig, (self, *args), kwargs)

    return cuda


def _wrap_cpu(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or self.device.type != accel:
            return orig(self, *args, **kwargs)
        return col.transfer("cpu", "d2h", None, int(self.nbytes), False, orig, (self, *args), kwargs)

    return cpu


def _wrap_copy(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def copy_(self: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or not isinstance(src, torch.Tensor):
            return orig(self, src, *args, **kwargs)
        direction = _direction(src.device.type, self.device.type, accel)
        if direction is None:
            return orig(self, src, *args, **kwargs)
        host = src if direction == "h2d" else self
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("copy_", direction, host, int(src.nbytes), nb, orig, (self, src, *args), kwargs)

    return copy_


def _wrap_read(col: TransferCollector, orig: Any, name: str) -> Any:
    """``.item()``, ``.tolist()``, ``bool()``, ...: a synchronous device-to-host read."""
    accel = col.accel
    op = name.strip("_")

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (
            _compiling()
            or col.busy()
            or self.device.type != accel
            or (name == "numpy" and not _flag(args, kwargs, "force"))
        ):
            return orig(self, *args, **kwargs)
        nbytes = int(self.element_size()) if name != "tolist" else int(self.nbytes)
        return col.transfer(op, "d2h", None, nbytes, False, orig, (self, *args), kwargs)

    read.__name__ = name
    return read


def _wrap_pin(col: TransferCollector, orig: Any, name: str) -> Any:
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy():
            return orig(self, *args, **kwargs)
        return col.pin(orig, self, args, kwargs)

    return pin_memory


def wrap_factory(col: TransferCollector, orig: Any, name: str) -> Any:
    """``torch.tensor(data, device=...)`` / ``torch.as_tensor``: a host-to-device copy of the result."""
    accel = col.accel

    def factory(data: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if _compiling() or col.busy() or device is None or _device_type(device, accel) != accel:
            return orig(data, *args, **kwargs)
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return orig(data, *args, **kwargs)  # no host side: already on a device
        return col.transfer(name, "h2d", None, -1, False, orig, (data, *args), kwargs)

    factory.__name__ = name
    return factory


TENSOR_WRAPPERS: dict[str, Callable[..., Any]] = {
    "to": _wrap_to,
    "cuda": _wrap_cuda,
    "cpu": _wrap_cpu,
    "copy_": _wrap_copy,
    "pin_memory": _wrap_pin,
    **dict.fromkeys(READS, _wrap_read),
}


# ---------------------------------------------------------------------------------------- helpers


def _target(args: tuple[Any, ...], kwargs: dict[str, Any], accel: str) -> str | None:
    """The device type ``Tensor.to(...)`` moves to, or None for a dtype/memory-format change only."""
    if "device" in kwargs:
        return _device_type(kwargs["device"], accel)
    if not args:
        return None
    first = args[0]
    if isinstance(first, torch.Tensor):
        return first.device.type
    return _device_type(first, accel)


def _device_type(value: Any, accel: str) -> str | None:
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        return value.partition(":")[0]
    if isinstance(value, int) and not isinstance(value, bool):
        return accel  # a bare index names an accelerator
    return None


def _direction(src: str, dst: str | None, accel: str) -> str | None:
    if src == "cpu" and dst == accel:
        return "h2d"
    if src == accel and dst == "cpu":
        return "d2h"
    return None


def _flag(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> bool:
    """A boolean option given by keyword, or as the first positional bool (``to(dev, dtype, True)``)."""
    if name in kwargs:
        return bool(kwargs[name])
    return next((a for a in args if isinstance(a, bool)), False)
