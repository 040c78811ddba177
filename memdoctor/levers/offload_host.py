"""The host side of offload, shared by the optimizer-state and the parameter offload: pinned host
buffers, waiting for queued copies, and the optimizer settings a step on the host needs (its
``capturable`` and ``fused`` flags, and where its state tensors live).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from memdoctor.patching import Undo


def _pin(host: torch.device) -> bool:
    """Pinned memory makes non_blocking copies truly asynchronous; it needs CUDA (not on CPU-only torch)."""
    return host.type == "cpu" and torch.cuda.is_available()


def host_buffer(like: torch.Tensor, host: torch.device) -> torch.Tensor:
    """An empty host tensor shaped like ``like`` (same dtype), pinned where that is possible."""
    return torch.empty(like.shape, dtype=like.dtype, device=host, pin_memory=_pin(host))


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on each CUDA device's current stream (no-op for the CPU)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """(group, parameter) for every parameter of the optimizer: a step's flags are the group's."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield group, p


def _fused_on(device_type: str) -> bool:
    """Whether torch has fused optimizer kernels for ``device_type`` (a private list, feature-checked)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the list: say no, and the fused flag is refused by name
        return False
    return device_type in _get_fused_kernels_supported_devices()


def fused_refusal(
    optimizer: torch.optim.Optimizer, on_host: Callable[[torch.Tensor], bool], host: torch.device
) -> str | None:
    """``fused=True`` on a group stepping host parameters works where torch has fused kernels for the
    host (the CPU, in torch >= 2.4); else the flag is refused by name (no silent change of kernels)."""
    for group in optimizer.param_groups:
        if group.get("fused") and any(on_host(p) for p in group["params"]) and not _fused_on(host.type):
            return (
                f"{type(optimizer).__name__}(fused=True) has no fused kernels on {host.type} in this torch; "
                "build it without fused=True"
            )
    return None


def host_capturable(
    optimizer: torch.optim.Optimizer, on_host: Callable[[torch.Tensor], bool]
) -> tuple[list[str], Undo]:
    """``capturable=True`` (for CUDA graphs) needs device parameters: set it to False on the groups that
    step host parameters, which computes the same update. Returns (notes, undo)."""
    changed = [
        g for g in optimizer.param_groups if g.get("capturable") and any(on_host(p) for p in g["params"])
    ]
    for group in changed:
        group["capturable"] = False

    def undo() -> None:
        for group in changed:
            group["capturable"] = True

    notes = [f"capturable=False on {len(changed)} param group(s) stepped on the host"] if changed else []
    return notes, undo


# torch.optim classes whose fused CPU kernel (torch >= 2.4) computes the same update (dense gradients only)
_FUSED_ON_CPU = ("Adam", "AdamW")


class HostFlags:
    """The param-group flags for a step on the host, set on each group the step meets (``apply`` each
    step: ``load_state_dict`` brings new group dicts), put back by ``undo``.

    ``capturable=True`` (CUDA graphs) needs device parameters: False on the host computes the same
    update. Where the script left the kernel to torch (``fused`` and ``foreach`` unset, Adam/AdamW), the
    step uses torch's fused CPU kernel: torch's own default there is its per-tensor loop, about 3x slower
    on the CPU (measured: AdamW, 33M parameters, 2 cores: 51 ms vs 16 ms per step), and the CPU step is
    offload's main cost. The same update, to float rounding; a script's explicit choice is kept.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, host: torch.device) -> None:
        self.optimizer = optimizer
        cls = type(optimizer)
        self.fuse = (
            cls.__module__.startswith("torch.optim.")
            and cls.__name__ in _FUSED_ON_CPU
            and _fused_on(host.type)
        )
        self._seen: list[dict[str, Any]] = []
        self._changed: list[tuple[dict[str, Any], str, Any]] = []
        self.notes: list[str] = []

    def apply(self) -> None:
        for group in self.optimizer.param_groups:
            if any(group is g for g in self._seen):
                continue
            self._seen.append(group)
            if group.get("capturable"):
                self._set(group, "capturable", False, "capturable=False on the host")
            if (
                self.fuse
                and group.get("fused") is None
                and group.get("foreach") is None
                and not group.get("differentiable")
                and all(torch.is_floating_point(p) for p in group["params"])
            ):
                self._set(group, "fused", True, "stepped with torch's fused CPU kernel (fused=True)")

    def _set(self, group: dict[str, Any], key: str, value: Any, note: str) -> None:
        self._changed.append((group, key, group.get(key)))
        group[key] = value
        if note not in self.notes:
            self.notes.append(note)

    def undo(self) -> None:
        while self._changed:
            group, key, value = self._changed.pop()
            group[key] = value
        self._seen.clear()


def state_to(
    optimizer: torch.optim.Optimizer,
    where: Callable[[torch.Tensor], torch.device],
    only: set[int] | None = None,
) -> None:
    """Move each parameter's (of ``only``, by id, if given) optimizer-state tensors to ``where(param)``.

    A scalar ``step`` of a group that is neither fused nor capturable stays where torch keeps it (the CPU).
    """
    for group, p in optimizer_params(optimizer):
        state = optimizer.state.get(p)
        if not state or (only is not None and id(p) not in only):
            continue
        target = where(p)
        host_step = not (group.get("fused") or group.get("capturable"))
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.device == target:
                continue
            if key == "step" and value.dim() == 0 and host_step and value.device.type == "cpu":
                continue
            state[key] = value.to(target)
