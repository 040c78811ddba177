"""The small pieces the session's hooks are made of: the forward stack's frames, the callables handed
to torch as tensor, gradient and weak-reference hooks, and the checks they run on every call.

Kept apart from ``ProfileSession`` so that the session reads as what happens when; each piece here is
a few lines that run on the hot path (every module call, every saved tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.device import Device

if TYPE_CHECKING:
    from memdoctor.capture.ledger import Ledger
    from memdoctor.capture.session import ProfileSession


class Frame:
    """One module call on the forward stack."""

    __slots__ = ("active", "input_ptrs", "input_saved", "key", "recompute", "sample", "saved_at_pre")

    def __init__(
        self,
        key: int,
        sample: int,
        saved_at_pre: int,
        input_ptrs: frozenset[int],
        active: bool = True,
        recompute: bool = False,
    ) -> None:
        self.key, self.sample, self.saved_at_pre = key, sample, saved_at_pre
        self.input_ptrs, self.input_saved, self.active = input_ptrs, 0, active
        self.recompute = recompute


NO_PTRS: frozenset[int] = frozenset()


class TensorHook:
    """A tensor hook that reports a module's backward start or end to the session."""

    __slots__ = ("depth", "event", "key", "session")

    def __init__(self, session: ProfileSession, event: str, key: int, depth: int) -> None:
        self.session, self.event, self.key, self.depth = session, event, key, depth

    def __call__(self, grad: torch.Tensor) -> None:
        if self.session._running:
            self.session.on_backward(self.event, self.key, self.depth, grad)


class GradHook:
    """Post-accumulate-grad hook: counts a parameter's gradient the moment it exists."""

    __slots__ = ("session",)

    def __init__(self, session: ProfileSession) -> None:
        self.session = session

    def __call__(self, param: torch.Tensor) -> None:
        if self.session._running:
            self.session.on_grad(param)


class Freed:
    """Weak-reference callback: a saved storage was freed."""

    __slots__ = ("ledger", "nbytes", "ptr")

    def __init__(self, ledger: Ledger, ptr: int, nbytes: int) -> None:
        self.ledger, self.ptr, self.nbytes = ledger, ptr, nbytes

    def __call__(self, _ref: Any) -> None:
        self.ledger.on_freed(self.ptr, self.nbytes)


def resident_check(device: Device) -> Callable[[torch.Tensor], bool] | None:
    """The test "is this tensor in the profiled device's memory", or None where every tensor is.

    A CUDA session counts the tensors on its own GPU (``device.index``; any GPU without one); a CPU
    session, or a ``FakeDevice`` standing in for a GPU in tests, counts every tensor, as host and device
    are one there. One ``.get_device()`` read a tensor: no synchronisation, cheap enough for hooks."""
    if device.kind != "cuda":
        return None
    index = getattr(device, "index", None)
    if index is None:
        return _is_cuda
    want = int(index)
    return lambda t: t.get_device() == want


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def pick_depth(calls_at_depth: dict[int, int], budget: int) -> int:
    """The deepest call depth at which timing every module call stays within budget calls a forward."""
    total, depth = 0, 0
    for d in sorted(calls_at_depth):
        total += calls_at_depth[d]
        if total > budget and d > 0:
            break
        depth = d
    return depth


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (private binding, feature-checked;
    without it, recomputed forwards count as forwards, as before)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


def unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def first_grad_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor in a module's inputs or outputs that takes part in autograd."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    if depth > 2:
        return None
    items: Any = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        found = first_grad_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def input_ptrs(args: tuple[Any, ...]) -> frozenset[int]:
    ptrs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            try:
                ptrs.append(a.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
    return frozenset(ptrs)
