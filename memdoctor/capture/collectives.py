"""Time and bytes each step spends in ``torch.distributed``'s collectives, measured on this rank; and,
once, the link between the ranks (``memdoctor.capture.link``).

Every collective a script, DDP's Python side or FSDP2 calls through ``torch.distributed`` (or its
``distributed_c10d`` module) is wrapped (``memdoctor.patching``, undone when the session stops) with a
device marker before and after it: wall time on a CPU, CUDA events on the calling stream on a GPU, read
once per step when the step's record is built, so nothing here synchronises with the GPU. A call with
``async_op=True`` (and ``isend``/``irecv``) returns before its transfer ends: its time is the launch
only, and such calls are counted apart (``async_calls``). A collective made inside another
(``all_gather_object`` calls ``all_gather``) counts once, as the inner primitive. Not seen here: DDP's
bucket all-reduces (its C++ reducer calls the process group directly), functional collectives
(``torch.distributed._functional_collectives``: DTensor's redistributions) and calls made from C++.
DDP's could be seen through a comm hook, but that would change the script: DDP takes one hook only
(the script's own ``register_comm_hook`` would then fail), and a Python hook averages the buckets
with a division where the reducer multiplies by 1/world_size, which rounds differently. So a DDP
step's ``collectives`` says they are not measured.

Written as the step record's ``collectives`` only while a process group is initialised: a one-process
script gets no new field, and costs only the wrappers' installation.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor import patching
from memdoctor.capture.link import measure_link

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession

# op -> the parameter holding the message: all-reduce and broadcast move their tensor; an all-gather is
# counted at its gathered output, a reduce-scatter at its input before scattering, an all-to-all at its
# input (the sizes nccl-tests reports, from which bus bytes follow with the usual (n-1)/n factors).
PAYLOAD: dict[str, str | None] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "all_gather": "tensor_list",
    "all_gather_coalesced": "output_tensor_lists",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "all_reduce_coalesced": "tensors",
    "gather": "tensor",
    "scatter": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "barrier": None,
    "monitored_barrier": None,
}
ALWAYS_ASYNC = ("isend", "irecv")
KEEP_STEPS = 4  # steps whose calls are kept for their records (a provisional and a final one each)


class Collectives:
    """The wrappers (``install``/``remove``) and the calls they saw, by step (``step_field``)."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        # step -> (op, bytes, marker before, marker after, asynchronous) of each call
        self.calls: dict[int, list[tuple[str, int, Any, Any, bool]]] = {}
        self._undo: list[patching.Undo] = []
        self._inside = threading.local()
        self._link_measured = False

    def install(self) -> None:
        dist = _dist()
        if dist is None or self._undo:
            return
        from torch.distributed import distributed_c10d

        for owner in (dist, distributed_c10d):
            for op in PAYLOAD:
                if callable(getattr(owner, op, None)):
                    self._undo.append(patching.wrap_attr(owner, op, self._wrapper(op)))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def _wrapper(self, op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            where = _positions(original, PAYLOAD[op])

            def call(*args: Any, **kwargs: Any) -> Any:
                s = self.session
                if getattr(self._inside, "on", False) or not s._running:
                    return original(*args, **kwargs)
                self._inside.on = True
                try:
                    m0 = s.device.marker()
                    out = original(*args, **kwargs)
                    m1 = s.device.marker()
                finally:
                    self._inside.on = False
                nbytes, is_async = _arguments(where, args, kwargs)
                step = s.current_step()
                self.calls.setdefault(step, []).append((op, nbytes, m0, m1, is_async or op in ALWAYS_ASYNC))
                return out

            return call

        return make

    def measure_link(self) -> None:
        """Once: the ``link`` record, if a process group of two or more ranks is up (``link.py``)."""
        if self._link_measured:
            return
        self._link_measured = True
        s = self.session
        data = s._calls.guarded("link bandwidth", measure_link, s.device)
        if data is not None:
            s.emit("link", data)

    def step_field(self, step: int) -> dict[str, Any] | None:
        """The step record's ``collectives``; None without an initialised process group."""
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return None
        for old in [k for k in self.calls if k < step - KEEP_STEPS]:
            del self.calls[old]
        device = self.session.device
        by_op: dict[str, dict[str, Any]] = {}
        total_ms, async_calls = 0.0, 0
        for op, nbytes, m0, m1, is_async in self.calls.get(step, []):
            ms = max(0.0, device.resolve_ms([m0, m1])[1])
            row = by_op.setdefault(op, {"ms": 0.0, "calls": 0, "bytes": 0})
            row["ms"] += ms
            row["calls"] += 1
            row["bytes"] += nbytes
            total_ms += ms
            async_calls += is_async
        for row in by_op.values():
            row["ms"] = round(row["ms"], 4)
        out: dict[str, Any] = {
            "ms": round(total_ms, 4),
            "calls": sum(r["calls"] for r in by_op.values()),
            "bytes": sum(r["bytes"] for r in by_op.values()),
            "by_op": by_op,
            "timing": "cuda_events" if device.kind == "cuda" else "wall",
            "async_calls": async_calls,
        }
        if self.session._engines.ddps:
            out["not_measured"] = ["DDP's gradient-bucket all-reduces (its C++ reducer calls them)"]
        return out


def _dist() -> Any:
    """``torch.distributed`` where this torch has it, else None."""
    dist = torch.distributed
    return dist if dist.is_available() else None


def _positions(fn: Callable[..., Any], payload: str | None) -> tuple[str | None, int, int]:
    """(payload parameter, its position, ``async_op``'s position; -1 where absent)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    pos = names.index(payload) if payload in names else -1
    return payload, pos, names.index("async_op") if "async_op" in names else -1


def _arguments(
    where: tuple[str | None, int, int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, bool]:
    """(bytes of the call's message, whether it was asynchronous)."""
    name, pos, async_pos = where
    payload = kwargs.get(name) if name is not None and name in kwargs else None
    if payload is None and 0 <= pos < len(args):
        payload = args[pos]
    is_async = kwargs.get("async_op", args[async_pos] if 0 <= async_pos < len(args) else False)
    return _nbytes(payload), bool(is_async)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0
