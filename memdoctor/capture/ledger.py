"""The memory ledger: the bytes the device holds in parameters, gradients, optimizer state and the
activations autograd saved, counted as they change, and mapped to the modules that own them.

The session's hooks call in here; every figure is a running counter (``params_bytes``, ``grads_live``,
``opt_bytes``, ``act_live``, and the engines' ``buckets_live`` and ``sharding_live``) that a sample
copies, so no hook scans memory on the hot path. Only tensors in the profiled device's memory count
(``resident``): offload keeps optimizer state, and chosen parameters and their gradients, on the host,
which the allocator does not hold either. A DTensor (FSDP2's shards) counts as its local shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.codesite import caller_site
from memdoctor.capture.discovery import DiscoveredModel, local_tensor, own_nbytes, storage_key, storage_nbytes
from memdoctor.capture.engines import Engines
from memdoctor.capture.sessionhooks import Frame, Freed
from memdoctor.capture.stepbuild import Sample, StepData
from memdoctor.device import Device

Loc = tuple[int, int]  # (model, module index)
# Samples a step takes at tensors saved outside every module (the loop's loss), at most: enough for the
# accounting to see what the loss holds as backward starts, bounded for loops with much code of their own.
MAX_OUTSIDE_SAMPLES = 64
# The depth-0 samples at which FSDP2's buffers are counted again (``Ledger.sample``).
_BOUNDARIES = frozenset(("step_start", "fwd_pre", "opt_pre", "opt_post"))


class Ledger:
    """Running byte counters and the scans behind them. ``models``, ``roots`` and ``optimizers`` are the
    session's own lists (they grow as it discovers them); ``data`` is the step in progress's."""

    def __init__(
        self,
        device: Device,
        resident: Callable[[torch.Tensor], bool] | None,
        models: list[DiscoveredModel],
        roots: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        stack: list[Frame],
        data: StepData,
        engines: Engines,
    ) -> None:
        self.device = device
        self.engines = engines
        engines.shards.on_grads = self.on_grads
        self.gathered = engines.gathered  # FSDP2's unsharded parameters: not activations when saved
        self.resident = resident
        self.models, self.roots, self.optimizers = models, roots, optimizers
        self.stack, self.data = stack, data
        self.param_ptrs: dict[int, int] = {}  # storage address -> bytes, of known parameters on the device
        # id(parameter) -> whether it lives on the profiled device, as seen outside optimizer steps
        # (inside one, an offloaded optimizer has swapped its parameters to host copies).
        self.home: dict[int, bool] = {}
        self.in_opt = False  # between the optimizer step's pre and post hooks
        self.params_stale = False  # parameters to recount once the optimizer step is over
        self.opt_cache: tuple[Any, ...] | None = None
        # (parameter, (model, module index)) of every discovered model, for the per-step scans.
        self.flat_params: list[tuple[torch.Tensor, Loc]] = []
        self.grads_counted: set[int] = set()
        self.grad_storages: set[int] = set()  # storages the running gradient count holds
        # id(parameter) -> (storage address, bytes) of its device gradient, as the gradient hook saw it
        self.grad_at: dict[int, tuple[int, int]] = {}
        self.saved: dict[int, tuple[int, Any]] = {}
        self.act_live = 0
        self.grads_live = 0
        self.opt_bytes = 0
        self.params_bytes = 0

    def on_device(self, t: torch.Tensor) -> bool:
        return self.resident is None or self.resident(local_tensor(t))

    # ------------------------------------------------------------------------------ samples
    def sample(self, event: str, key: int | None, depth: int) -> int:
        """Append a sample (a device time marker and the running counters) to the step in progress;
        its index. Every hook only does this: the record is built from the samples once per step."""
        data, device = self.data, self.device
        mem = None
        # The allocator's figures cost ~150 us a read on CUDA: read them at step, root-forward,
        # top-level backward and optimizer boundaries only; the step's true peak comes from
        # max_memory_allocated.
        if device.has_allocator and (depth == 0 or (depth == 1 and event[0] == "b")):
            mem = device.memory()
        engines = self.engines
        if depth == 0 and engines.shards.groups and event in _BOUNDARIES:
            # FSDP2's buffers counted afresh at the step's boundaries: all timing steps see of them,
            # and what its root's final callback released outside any group call.
            engines.shards.refresh()
        data.samples.append(
            Sample(
                device.marker(),
                event,
                key,
                depth,
                self.params_bytes,
                self.grads_live,
                self.opt_bytes,
                self.act_live,
                mem,
                engines.buckets_live,
                engines.sharding_live,
            )
        )
        if event == "bwd_pre" or event == "bwd_post":
            data.phase = "backward"
        elif event == "fwd_pre" and depth == 0:
            data.phase = "forward"
        elif event == "opt_pre":
            data.phase = "optimizer"
        return len(data.samples) - 1

    # ------------------------------------------------------------------------------ parameters
    def note_params(self) -> None:
        """Count the parameters of every model seen that live on the profiled device.

        Never inside an optimizer step: an offloaded optimizer steps host copies swapped into
        ``p.data`` there, which are not the device's parameters; the count waits for the next forward."""
        if self.in_opt:
            self.params_stale = True
            return
        self.params_stale = False
        ptrs: dict[int, int] = {}
        home: dict[int, bool] = {}
        roots = {id(r): r for r in [*self.roots, *(m.modules[0] for m in self.models)]}
        for root in roots.values():
            for p in root.parameters():
                here = home[id(p)] = self.on_device(p)
                if here:
                    ptrs.setdefault(storage_key(p), storage_nbytes(p))
        # A new dict: the records of finished steps still being built keep the one they were made with.
        self.param_ptrs, self.home = ptrs, home
        self.params_bytes = sum(ptrs.values())

    # ------------------------------------------------------------------------------ gradients
    def device_grad(self, p: torch.Tensor) -> tuple[int | None, int]:
        """(storage address, bytes) of ``p``'s gradient on the profiled device; (None, 0) without one.

        Gradients that share a storage count it once (its address is the key). A gradient that is a
        view into a DDP bucket (``gradient_as_bucket_view``) is keyed by its own address and counts
        its own slot: the rest of the bucket is ``gradient_buckets``.

        A parameter that lives on the device but whose data is on the host now is being stepped on the
        host (``memdoctor.levers.offload.OptimizerOffload`` swaps ``p.data`` and ``p.grad`` to host
        copies for the optimizer's own step): its device gradient is still allocated, held by the
        swap, as large as the host copy that stands in for it; its address is the one the gradient hook
        saw in backward (None on steps without that hook)."""
        g = p.grad
        if g is None:
            return None, 0
        g = local_tensor(g)
        if self.on_device(g):
            if id(p) in self.engines.bucket_params:
                return g.data_ptr(), own_nbytes(g)
            return storage_key(g), storage_nbytes(g)
        if self.home.get(id(p), False) and not self.on_device(p):
            return self.grad_at.get(id(p)) or (None, g.numel() * g.element_size())
        return None, 0

    def first_forward(self) -> None:
        """The step's first forward: the gradients alive now (accumulated ones) are its starting point."""
        _, seen, self.grads_live = self._grad_holdings()
        self.grads_counted = {id(p) for p, _ in self.flat_params if p.grad is not None}
        self.grad_storages = set(seen)
        self.grad_at = {}
        self.engines.shards.refresh()

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (``register_post_accumulate_grad_hook``), or FSDP2
        reduced it into its shard (``on_grads``)."""
        order = self.data.grad_order  # backward order, for the first module with a NaN/Inf gradient
        if id(param) not in order:
            order[id(param)] = len(order)
        grad = param.grad
        if id(param) in self.grads_counted or grad is None or not self.on_device(grad):
            return
        self.grads_counted.add(id(param))
        key, n = at = self.device_grad(param)
        self.grad_at[id(param)] = at  # type: ignore[assignment]
        if id(param) in self.engines.bucket_params:
            self.engines.bucket_grads += n
        elif key in self.grad_storages:
            return  # one more gradient in a storage already counted (FSDP2's reduce-scatter output)
        self.grad_storages.add(key)  # type: ignore[arg-type]
        self.grads_live += n

    def on_grads(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self.on_grad(p)

    def grads_by_module(self) -> dict[Loc, int]:
        out, seen, _ = self._grad_holdings()
        self.data.grad_ptrs = seen
        return out

    def count_grads(self) -> int:
        return self._grad_holdings()[2]

    def _grad_holdings(self) -> tuple[dict[Loc, int], dict[int, int], int]:
        """Per module, the bytes of the gradients its parameters hold on the device; storage address
        -> bytes of those storages; their total. Each storage counts once. A gradient that is one
        slot of a flat storage (FSDP2's reduce-scatter output) is charged its own bytes, the rest of
        the storage (padding) to the module of the storage's first gradient; one in a DDP bucket, its
        slot (``device_grad``). Also sets the engines' count of bucket-view gradient bytes."""
        out: dict[Loc, int] = {}
        seen: dict[int, int] = {}
        left: dict[int, list[Any]] = {}  # flat storage -> [first module, bytes no gradient is charged]
        buckets = self.engines.bucket_params
        in_buckets = 0
        for p, loc in self.flat_params:
            if p.grad is None:
                continue
            key, n = self.device_grad(p)
            if not n or (key is not None and key in seen and key not in left):
                continue
            charge = n
            if id(p) in buckets:
                in_buckets += n
            elif key is not None and (own := own_nbytes(p.grad)) < n:
                slot = left.setdefault(key, [loc, n])
                slot[1] -= own
                charge = own
            out[loc] = out.get(loc, 0) + charge
            if key is not None:
                seen[key] = n
        for loc, rest in left.values():
            out[loc] = out.get(loc, 0) + max(0, rest)
        self.engines.bucket_grads = in_buckets
        return out, seen, sum(out.values())

    # ------------------------------------------------------------------------------ optimizer state
    def opt_state_by_module(self) -> dict[Loc, int]:
        """Optimizer state is created once and updated in place: rescan only when it grows or moves
        (offload moves state a checkpoint loaded onto the device to the host at its first step)."""
        shape = tuple((id(o), len(o.state), self._state_where(o)) for o in self.optimizers)
        if self.opt_cache is None or self.opt_cache[0] != shape:
            self.opt_cache = (shape, *self.scan_opt_state())
        _, out, total, seen = self.opt_cache
        self.opt_bytes = total
        self.data.opt_ptrs = seen
        return out

    def scan_opt_state(self) -> tuple[dict[Loc, int], int, dict[int, int]]:
        out: dict[Loc, int] = {}
        seen: dict[int, int] = {}
        for opt in self.optimizers:
            for p, state in opt.state.items():
                loc = self._owner_of(p)
                for v in state.values() if isinstance(state, dict) else ():
                    # Only state on the profiled device: not AdamW's step counters, which it keeps on the
                    # host, nor the state an offloaded optimizer keeps there (this scan may run inside
                    # its step, where the parameters themselves are host copies). On a CPU session
                    # everything is on the device, as the state is.
                    if not isinstance(v, torch.Tensor) or not self.on_device(v):
                        continue
                    if storage_key(v) not in seen:
                        n = seen[storage_key(v)] = storage_nbytes(v)
                        if loc is not None:
                            out[loc] = out.get(loc, 0) + n
        return out, sum(seen.values()), seen

    def _state_where(self, opt: torch.optim.Optimizer) -> bool | None:
        """Whether the first state tensor of ``opt`` is on the profiled device (None: no state yet)."""
        for state in opt.state.values():
            for v in state.values() if isinstance(state, dict) else ():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    return self.on_device(v)
            return None
        return None

    def _owner_of(self, p: Any) -> Loc | None:
        for model in self.models:
            i = model.param_owner.get(id(p))
            if i is not None:
                return (model.info.index, i)
        return None

    # ------------------------------------------------------------------------------ saved tensors
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors pack hook. Hot path: every tensor autograd saves. Identity is the storage,
        so views count once."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            return t
        ptr = st.data_ptr()
        if ptr in self.saved or ptr in self.param_ptrs or not ptr or ptr in self.gathered:
            return t
        if self.resident is not None and not self.resident(t):
            return t  # a host tensor kept for backward: not in the device's memory
        nbytes = st.nbytes()
        self.saved[ptr] = (nbytes, weakref.ref(st, Freed(self, ptr, nbytes)))
        self.act_live += nbytes
        data = self.data
        data.saved_total += nbytes
        data.saved_ptrs[ptr] = nbytes
        stack = self.stack
        if stack:
            top = stack[-1].key
            data.act_self[top] = data.act_self.get(top, 0) + nbytes
            for frame in stack:
                if ptr in frame.input_ptrs:
                    frame.input_saved += nbytes
        if len(stack) <= 1:
            self.saved_outside(nbytes)
        return t

    def saved_outside(self, nbytes: int) -> None:
        """A tensor saved by code that no child module runs: the root module's own forward code (one
        frame on the stack) or the training loop's (none: a loss computed from the model's output). By
        the line that saved it, as no module's figures hold it; outside every module, a sample too, so
        that the accounting sees what the loss holds when backward starts."""
        stack, data = self.stack, self.data
        if stack and not stack[0].active:
            return  # a forward without gradients, or one recomputed in backward: not this step's own
        key = (stack[0].key if stack else None, caller_site())
        data.outside_micro[key] = data.outside_micro.get(key, 0) + nbytes
        if not stack and data.outside_samples < MAX_OUTSIDE_SAMPLES:
            data.outside_samples += 1
            self.sample("outside", None, 0)

    def on_freed(self, ptr: int, nbytes: int) -> None:
        entry = self.saved.get(ptr)
        if entry is not None and entry[0] == nbytes:
            del self.saved[ptr]
            self.act_live -= nbytes
