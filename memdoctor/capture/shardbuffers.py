"""FSDP2's own buffers, as a running counter: the unsharded parameters an all-gather fills, the
all-gather output kept for the next copy-out, the unsharded gradients autograd accumulates into the
gathered parameters before their reduce-scatter, and the reduce-scatter inputs kept for the next
reduce-scatter, each attributed to the ``fully_shard`` module whose parameters it holds.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps a module's parameters as DTensor shards and
gathers them around its forward and backward. What a module holds gathered lives in its parameter
group (``FSDPParamGroup``), which no public API exposes; torch's own ``FSDPMemTracker`` reads it by
wrapping that group's methods, and so does this module: after each ``unshard``, ``wait_for_unshard``,
``reshard``, ``post_backward`` and ``finalize_backward`` of a group, that group's holdings are counted
again (a few storage reads), so the counter is right at every sample the session takes; and after
each gradient accumulated into a gathered parameter (a hook on it), and after the outermost
``fully_shard`` module's forward, whose post-forward (not a group method) frees the last all-gather
output: neither is marked by a group method. Prefetching
gathers the next module's parameters early: those bytes are charged to that module, whose parameters
they are. The wrappers go through ``memdoctor.patching`` and are private API, used only on torch
versions known to have it (``group_class``); elsewhere, or if FSDP's internals moved, the buffers are
not measured and the trace says so (``Engines.facts``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from memdoctor import patching

# The parameter group's methods after which what it holds has changed.
WRAPPED = ("unshard", "wait_for_unshard", "reshard", "post_backward", "finalize_backward")
_GROUP_ATTRS = ("fsdp_params", "comm_ctx", "modules", "_all_gather_result", *WRAPPED)
_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
FIRST_VERSION = (2, 6)  # fully_shard public in torch.distributed.fsdp, its groups in _fully_shard


def group_class() -> type | None:
    """FSDP2's ``FSDPParamGroup`` where this torch has it as this module reads it, else None."""
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < FIRST_VERSION:
        return None
    try:
        import importlib

        cls = getattr(importlib.import_module(_MODULE), "FSDPParamGroup", None)
    except ImportError:
        return None
    if cls is None or not all(hasattr(cls, a) for a in WRAPPED):
        return None
    return cls


def fsdp_groups(root: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``root`` and the modules inside it (``fully_shard`` modules)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if module_cls is None:
        return []
    groups = []
    for m in root.modules():
        if isinstance(m, module_cls):
            state = m._get_fsdp_state()
            group = getattr(state, "_fsdp_param_group", None)
            if group is not None:
                groups.append(group)
    return groups


class ShardBuffers:
    """Bytes FSDP2's groups hold beyond their shards: ``live`` (all groups now), ``ptrs`` (storage
    address -> group of every unsharded parameter's storage, which the ledger's saved-tensor hook
    must not count as an activation: autograd saves the gathered weight a forward used), and the step's
    most per module (``peak``, reset by the ledger at each step)."""

    def __init__(
        self, locate: Callable[[Any], tuple[int, int] | None], on_device: Callable[[torch.Tensor], bool]
    ) -> None:
        self.locate = locate  # group -> (model, module index) of its fully_shard module, once known
        self.on_device = on_device  # on the profiled device (CPUOffloadPolicy keeps shards on the host)
        self.groups: dict[int, Any] = {}
        self.held: dict[int, dict[int, int]] = {}  # id(group) -> {storage address: bytes}
        self.ptrs: dict[int, int] = {}
        self.live = 0
        self.peak: dict[tuple[int, int], int] = {}
        self.watching = False  # steps with the per-module ledger: count at every group call
        self.on_grads: Callable[[list[Any]], None] = lambda params: None
        self.off: str | None = None  # why the buffers are not measured (None: they are)
        self._owner: dict[int, int] = {}  # id(all-gather result or reduce-scatter input) -> id(group)
        self._undo: list[patching.Undo] = []
        self._grad_hooks: dict[int, Any] = {}  # id(unsharded parameter) -> its accumulate-grad hook
        self._root_hooks: dict[int, Any] = {}  # id(outermost fully_shard module) -> its forward hook

    # ------------------------------------------------------------------------------ install
    def add(self, groups: list[Any]) -> None:
        """Watch these groups; the first time, wrap the group class's methods."""
        if not groups or self.off:
            return
        if not self._undo:
            cls = group_class()
            if cls is None:
                self.off = f"FSDP2 buffers: memdoctor cannot read FSDP2's groups in torch {torch.__version__}"
                return
            self._undo = [patching.wrap_attr(cls, name, self._wrapper(name)) for name in WRAPPED]
        for group in groups:
            self.groups.setdefault(id(group), group)
        top = groups[0].modules[0]  # fsdp_groups' first: the outermost fully_shard module
        if id(top) not in self._root_hooks:  # runs after FSDP2's own post-forward (registered before)
            self._root_hooks[id(top)] = top.register_forward_hook(self._after_forward)
        self.refresh()

    def remove(self) -> None:
        """Undo the wrappers (safe to call twice); the counters stop here."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        for handle in [*self._grad_hooks.values(), *self._root_hooks.values()]:
            handle.remove()
        self._grad_hooks, self._root_hooks = {}, {}

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        """The outermost module's forward ended: FSDP2 has just dropped the last all-gather output
        (its root post-forward), which a stale count would still hold, and would keep the loss's
        saved tensors, allocated where that output was, out of the activations."""
        if self.watching and not self.off:
            self.refresh()

    def _wrapper(self, name: str) -> Callable[[Any], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(group: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(group, *args, **kwargs)
                if self.watching and not self.off:
                    self._changed(group, name)
                return out

            return call

        return make

    # ------------------------------------------------------------------------------ counting
    def refresh(self) -> None:
        """Count every group's holdings again (at step boundaries: timing steps count only there)."""
        if self.off:
            return
        for group in list(self.groups.values()):
            self._guarded(self._count, group)
        self._prune()

    def _changed(self, group: Any, name: str) -> None:
        gid = id(group)
        self.groups.setdefault(gid, group)
        # The shared context's buffers change hands too: a copy-out frees the previous group's
        # all-gather output, a post-backward the oldest reduce-scatter input; their owners recount.
        owners = set(self._owner.values())
        if name == "unshard" and group._all_gather_result is not None:
            self._owner[id(group._all_gather_result)] = gid
        elif name == "post_backward":
            for state in _reduce_scatter_states(group.comm_ctx):
                self._owner.setdefault(id(state.reduce_scatter_input), gid)
            self.on_grads([fp.sharded_param for fp in group.fsdp_params])
        self._guarded(self._count, group)
        for other in owners - {gid}:
            if other in self.groups:
                self._guarded(self._count, self.groups[other])
        self._prune()

    def _guarded(self, fn: Callable[[Any], None], group: Any) -> None:
        if self.off:
            return
        try:
            fn(group)
        except Exception as exc:  # FSDP's internals moved: stop reading them, say so, run on
            why = f"{type(exc).__name__}: {exc}"
            self.off = f"FSDP2 buffers: memdoctor could not read FSDP2's parameter group ({why})"[:400]
            self.live, self.held = 0, {}
            self.ptrs.clear()  # in place: the ledger's saved-tensor hook holds this dict
            self.remove()

    def _count(self, group: Any) -> None:
        held: dict[int, int] = {}
        for fp in group.fsdp_params:
            for t in fp.all_gather_outputs:  # the unsharded parameters (freed to 0 bytes when resharded)
                self._hold(held, t)
            for t in getattr(fp, "_unsharded_inner_tensors", ()) or ():
                self._hold(held, t)
            self._unsharded_grads(group, fp, held)
        pending = group._all_gather_result  # gathered (prefetched), not yet copied out
        if pending is not None:
            self._hold(held, pending.all_gather_output)
        reduce_state = getattr(group, "_all_reduce_state", None)  # HSDP's all-reduce input
        if reduce_state is not None:
            self._hold(held, reduce_state.all_reduce_input)
        partial = getattr(group, "_partial_reduce_output", None)
        if isinstance(partial, torch.Tensor):
            self._hold(held, partial)
        self._shared(group.comm_ctx, id(group), held)
        gid = id(group)
        old = self.held.get(gid, {})
        for ptr in old:
            if self.ptrs.get(ptr) == gid:
                del self.ptrs[ptr]
        for ptr in held:
            self.ptrs[ptr] = gid
        self.held[gid] = held
        self.live += sum(held.values()) - sum(old.values())
        loc = self.locate(group)
        if loc is not None:
            self.peak[loc] = max(self.peak.get(loc, 0), sum(held.values()))

    def _unsharded_grads(self, group: Any, fp: Any, held: dict[int, int]) -> None:
        """The gradients of ``fp``'s gathered parameter (accumulated by autograd in backward, until
        the group's post-backward copies them into its reduce-scatter input and drops them), and the
        accumulated copy FSDP2 keeps across backwards without a reduce-scatter. The gathered
        parameter lives from the first all-gather on: a hook on it recounts the group as each
        gradient lands."""
        param = getattr(fp, "_unsharded_param", None)
        if not isinstance(param, torch.Tensor):
            return
        if id(param) not in self._grad_hooks:
            self._grad_hooks[id(param)] = param.register_post_accumulate_grad_hook(
                lambda p, group=group: self._grad_landed(group)
            )
        for t in (param.grad, getattr(fp, "unsharded_accumulated_grad", None)):
            if isinstance(t, torch.Tensor):
                self._hold(held, t)

    def _grad_landed(self, group: Any) -> None:
        if self.watching and not self.off:
            self._guarded(self._count, group)

    def _shared(self, ctx: Any, gid: int, held: dict[int, int]) -> None:
        """What the shared communication context keeps for ``gid``'s group: its all-gather output
        until the next group's copy-out, its reduce-scatter inputs until they are reclaimed."""
        state = getattr(ctx, "all_gather_state", None)
        if state is not None and self._owner.get(id(state.all_gather_result)) == gid:
            self._hold(held, state.all_gather_result.all_gather_output)
        for rs in _reduce_scatter_states(ctx):
            if self._owner.get(id(rs.reduce_scatter_input)) == gid:
                self._hold(held, rs.reduce_scatter_input)

    def _hold(self, held: dict[int, int], t: torch.Tensor) -> None:
        """Add ``t``'s storage, if it holds bytes on the profiled device."""
        with contextlib.suppress(RuntimeError, NotImplementedError, AttributeError):
            st = t.untyped_storage()
            n = int(st.nbytes())
            if n and self.on_device(t):
                held[st.data_ptr()] = n

    def _prune(self) -> None:
        """Forget the owners of buffers no longer kept (their ids may be reused)."""
        kept: set[int] = set()
        for group in self.groups.values():
            if group._all_gather_result is not None:
                kept.add(id(group._all_gather_result))
            ctx = group.comm_ctx
            state = getattr(ctx, "all_gather_state", None)
            if state is not None:
                kept.add(id(state.all_gather_result))
            kept.update(id(rs.reduce_scatter_input) for rs in _reduce_scatter_states(ctx))
        for key in [k for k in self._owner if k not in kept]:
            del self._owner[key]


def _reduce_scatter_states(ctx: Any) -> list[Any]:
    """The reduce-scatter inputs the context keeps (a list in torch 2.13, one state before)."""
    states = getattr(ctx, "reduce_scatter_states", None)
    if states is not None:
        return list(states)
    one = getattr(ctx, "reduce_scatter_state", None)
    return [one] if one is not None else []
