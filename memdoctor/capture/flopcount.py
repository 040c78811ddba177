"""The counting itself: a ``TorchDispatchMode`` that tallies each aten op's FLOPs and bytes moved by
phase and by module (``flops.py`` says why our own mode and how backward ops find their module).

``CountingMode`` runs on every op of the measured step, so it keeps to a formula lookup, a few byte
counts and a dictionary update per op; ``Tally`` holds the totals and turns them into the step
record's ``collectors.flops`` field.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COUNTER = "torch.utils.flop_counter"
TOP_OPS = 20
RETRY = 4  # outputs still without an autograd node, kept for a later look (see CountingMode.resolve)
PHASES = ("forward", "backward", "optimizer", "other")
Tag = tuple[int, ...]  # id(module) of every module on the forward call stack, outermost first


class Tally:
    """What the counting mode adds up: totals by phase, per module and per op."""

    def __init__(self) -> None:
        self.flops = dict.fromkeys(PHASES, 0)
        self.bytes = dict.fromkeys(PHASES, 0)
        self.modules: dict[int, list[int]] = {}  # key -> [fwd flops, bwd flops, fwd bytes, bwd bytes]
        self.ops: dict[str, list[int]] = {}  # op name -> [flops, bytes, calls]
        self.by_dtype: dict[str, int] = {}
        self.unattributed = 0  # forward/backward FLOPs outside any module (a loss computed outside)
        self.formula_errors = 0
        # On CUDA, autograd runs GPU nodes on its device thread while the calling thread may run CPU
        # nodes of the same backward: both add here.
        self._lock = threading.Lock()

    def add(self, name: str, phase: str, tag: Tag | None, flops: int, nbytes: int, dtype: str | None) -> None:
        with self._lock:
            self._add(name, phase, tag, flops, nbytes, dtype)

    def _add(
        self, name: str, phase: str, tag: Tag | None, flops: int, nbytes: int, dtype: str | None
    ) -> None:
        self.flops[phase] += flops
        self.bytes[phase] += nbytes
        op = self.ops.get(name)
        if op is None:
            op = self.ops[name] = [0, 0, 0]
        op[0] += flops
        op[1] += nbytes
        op[2] += 1
        if flops and dtype is not None:
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + flops
        if phase not in ("forward", "backward"):
            return
        if not tag:
            self.unattributed += flops
            return
        col = 0 if phase == "forward" else 1
        for key in tag:
            acc = self.modules.get(key)
            if acc is None:
                acc = self.modules[key] = [0, 0, 0, 0]
            acc[col] += flops
            acc[col + 2] += nbytes

    def field(self, step: int, complete: bool) -> dict[str, Any]:
        top = sorted(self.ops.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:TOP_OPS]
        return {
            "step": step,
            "perturbed": True,
            "complete": complete,
            "counter": COUNTER,
            "flops": {**self.flops, "total": sum(self.flops.values())},
            "bytes": {**self.bytes, "total": sum(self.bytes.values())},
            "flops_by_dtype": dict(sorted(self.by_dtype.items())),
            "unattributed_flops": self.unattributed,
            "formula_errors": self.formula_errors,
            "ops": sum(v[2] for v in self.ops.values()),
            "top_ops": [{"op": k, "flops": v[0], "bytes": v[1], "calls": v[2]} for k, v in top],
        }


class CountingMode(TorchDispatchMode):
    """Counts every aten op's FLOPs and bytes into a ``Tally``, attributed to modules.

    Forward: the tag is the collector's module stack. Each forward op's outputs are kept until the op
    has returned through autograd (the next op, or a module boundary), then their ``grad_fn`` gets
    hooks that put the node's tag on a per-thread stack while autograd runs it (on CUDA that is
    autograd's device thread; the dispatch mode is propagated there)."""

    def __init__(
        self, tally: Tally, formulas: dict[Any, Callable[..., int]], phase: Callable[[], str]
    ) -> None:
        super().__init__()
        self.tally, self.formulas, self.phase = tally, formulas, phase
        self.fwd_tag: Tag = ()
        self._stack: list[int] = []
        self._pending: tuple[list[torch.Tensor], Tag] | None = None
        self._retry: list[torch.Tensor] = []
        # Nodes tagged since the last top-level call (an op may return a tensor whose node another op
        # made); nodes take no weak references, so this is cleared at each top-level call.
        self._tagged: set[Any] = set()
        self._local = threading.local()
        self.active = True
        self.error: str | None = None  # why counting stopped early, if it did

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: torch.compile'd code compiles and runs compiled while this mode counts (torch >= 2.8
        asks; older torch never calls it). With the default False, dynamo skips every frame it meets
        under the mode, and for good: one counted step would leave the model eager for the whole run.
        The price: ops inside compiled code are seen as the compiled code runs them (fused kernels are
        not aten ops), so a compiled region's FLOPs may be under-counted (the summary says so)."""
        return True

    # -------------------------------------------------------------------- the forward call stack
    def enter_module(self, key: int) -> None:
        self.resolve()
        if not self._stack:  # a new top-level call: the earlier graph's nodes need no dedup any more
            self._tagged, self._retry = set(), []
        self._stack.append(key)
        self.fwd_tag = tuple(dict.fromkeys(self._stack))

    def leave_module(self, key: int) -> None:
        self.resolve()
        stack = self._stack
        while stack:  # an exception inside a child skipped its post hook: unwind to this module
            if stack.pop() == key:
                break
        self.fwd_tag = tuple(dict.fromkeys(stack))

    # -------------------------------------------------------------------- autograd node tags
    def _bwd_tags(self) -> list[tuple[Tag, int]]:
        """This thread's autograd nodes being run: (tag, forward stack depth at entry), innermost last."""
        tags: list[tuple[Tag, int]] | None = getattr(self._local, "tags", None)
        if tags is None:
            tags = self._local.tags = []
        return tags

    def resolve(self) -> None:
        """Tag the autograd nodes of the last forward op's outputs with that op's module stack.

        Outputs without a node are kept a little longer (the last ``RETRY`` of them): an autograd
        ``Function`` (a reentrant checkpoint) gives its output a node only once its forward, run under
        ``no_grad``, has returned; that node belongs to the module that applied it, the one running
        when the node shows up."""
        pending, self._pending = self._pending, None
        if pending is not None:
            outs, tag = pending
            for t in outs:
                if t.grad_fn is not None:
                    self._tag(t.grad_fn, tag)
        if self._retry:
            waiting = []
            for t in self._retry:
                if t.grad_fn is not None:
                    self._tag(t.grad_fn, self.fwd_tag)
                else:
                    waiting.append(t)
            self._retry = waiting
        if pending is not None:
            self._retry += [t for t in pending[0] if t.grad_fn is None]
            del self._retry[:-RETRY]

    def _tag(self, node: Any, tag: Tag) -> None:
        if node is None or not tag or node in self._tagged:
            return
        self._tagged.add(node)
        node.register_prehook(_EnterNode(self, tag))
        node.register_hook(_LeaveNode(self))

    def enter_node(self, tag: Tag) -> None:
        # The forward stack's depth too: a checkpoint that recomputes modules inside this node may
        # stop them early with an exception that skips their post hooks; leaving the node unwinds them.
        self._bwd_tags().append((tag, len(self._stack)))

    def leave_node(self) -> None:
        tags = self._bwd_tags()
        if not tags:
            return
        _, depth = tags.pop()
        if len(self._stack) > depth:
            del self._stack[depth:]
            self.fwd_tag = tuple(dict.fromkeys(self._stack))

    def release(self) -> None:
        """Drop the references this step kept (nodes, pending outputs)."""
        self._pending, self._retry = None, []
        self._tagged = set()

    # -------------------------------------------------------------------- counting
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        try:
            self.resolve()
            phase, tag = self._where()
        except Exception as exc:
            self.fail(exc)
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet not in self.formulas and func is not torch.ops.prim.device.default:
            with self:  # composite ops: count the ops they decompose into (as FlopCounterMode does)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                self._book(None, packet, args, kwargs, out, phase, tag)
                return out
        out = func(*args, **kwargs)  # the op itself: its errors are the script's, and propagate
        self._book(func, packet, args, kwargs, out, phase, tag)
        return out

    def _book(
        self, func: Any, packet: Any, args: Any, kwargs: Any, out: Any, phase: str, tag: Tag | None
    ) -> None:
        """Count the op (``func`` None: it was decomposed, its parts were counted) and keep its outputs.
        A failure here is memdoctor's, never the script's: counting stops and the field says why."""
        try:
            if func is not None:
                self._count(func, packet, args, kwargs, out, phase, tag)
            self._after(out, tag)
        except Exception as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.active = False
        self.error = f"{type(exc).__name__}: {exc}"[:300]

    def _where(self) -> tuple[str, Tag | None]:
        """The phase of the op about to run and the modules it belongs to.

        In backward: the tag of the autograd node running it, plus the modules running forward inside
        that node (a checkpoint recomputing them); outside any tagged node (a loss computed outside
        the model, gradient accumulation) only the latter, usually none."""
        tags = self._bwd_tags()
        if tags:
            return "backward", _recomputed(tags[-1][0], self.fwd_tag)
        if _in_backward():
            return "backward", self.fwd_tag or None
        phase = self.phase()
        return phase, self.fwd_tag if phase == "forward" else None

    def _after(self, out: Any, tag: Tag | None) -> None:
        """Keep the outputs of an op run inside a module's forward (also when a checkpoint recomputes
        it in backward) until their autograd node exists."""
        if not tag or not self.fwd_tag:
            return
        outs = [t for t in _tensors(out) if t.requires_grad or t.is_floating_point()]
        if outs:
            self._pending = (outs, tag)

    def _count(
        self, func: Any, packet: Any, args: Any, kwargs: dict[str, Any], out: Any, phase: str, tag: Tag | None
    ) -> None:
        tally = self.tally
        flops = 0
        formula = self.formulas.get(packet)
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that cannot handle these arguments: count the op as zero
                tally.formula_errors += 1
        nbytes = 0
        if not getattr(func, "is_view", False):  # a view moves no data
            nbytes = _nbytes(args) + _nbytes(tuple(kwargs.values())) + _nbytes(out)
        tally.add(str(packet), phase, tag, flops, nbytes, _first_dtype(args) if flops else None)


class _EnterNode:
    """Autograd node pre-hook: the node's backward ops belong to ``tag``."""

    __slots__ = ("mode", "tag")

    def __init__(self, mode: CountingMode, tag: Tag) -> None:
        self.mode, self.tag = mode, tag

    def __call__(self, grad_outputs: Any) -> None:
        with contextlib.suppress(Exception):  # runs inside the script's backward: never raise there
            self.mode.enter_node(self.tag)


class _LeaveNode:
    """Autograd node post-hook: the node is done."""

    __slots__ = ("mode",)

    def __init__(self, mode: CountingMode) -> None:
        self.mode = mode

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        with contextlib.suppress(Exception):
            self.mode.leave_node()


def _recomputed(node_tag: Tag, fwd_tag: Tag) -> Tag:
    """The modules of an op a checkpoint recomputes inside an autograd node: the node's modules down
    to (not including) the first module now running forward, then those (the recomputed module
    is the one the node's tag already reached, or sits below its last module)."""
    if not fwd_tag:
        return node_tag
    cut = node_tag.index(fwd_tag[0]) if fwd_tag[0] in node_tag else len(node_tag)
    return tuple(dict.fromkeys(node_tag[:cut] + fwd_tag))


UNKNOWN = object()
# -1 outside a backward pass; a private API, so only where this torch has it.
_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (False where torch cannot say:
    the session's phase decides then)."""
    return _graph_task_id is not None and _graph_task_id() != -1


def innermost_mode() -> Any:
    """The innermost dispatch mode, or ``UNKNOWN`` where this torch does not say (private API)."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
    except ImportError:
        return UNKNOWN
    return _get_current_dispatch_mode()


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """The tensors in an aten op's argument or result (tensors, lists/tuples of them, one level deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (tuple, list)):
                yield from (y for y in x if isinstance(y, torch.Tensor))


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _first_dtype(args: Any) -> str | None:
    for t in _tensors(args):
        return str(t.dtype).removeprefix("torch.")
    return None
