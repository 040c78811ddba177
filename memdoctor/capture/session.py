"""The profiling session: hooks that turn a running training script into step records.

What it installs, all through PyTorch's own public hook APIs, and removes again on ``stop()``:

* global module forward pre/post hooks (``register_module_forward_pre_hook``): the module stack, the
  forward time of every module, and per-call tensor hooks on inputs and outputs that mark the start and
  end of each module's backward (tensor hooks rather than ``register_full_backward_hook``, which wraps
  module outputs and breaks modules that work in place, such as ``ReLU(inplace=True)``);
* a global saved-tensors hook (``torch.autograd.graph.saved_tensors_hooks``): every tensor autograd keeps
  for backward, attributed to the innermost module running, each storage counted once, parameters
  excluded; a weak reference on the storage tells when it is freed;
* global optimizer step pre/post hooks: a training step is detected without the user's help, gradients
  and optimizer state are measured and mapped to the modules that own the parameters.

Every hook only appends a sample (a time marker plus the running byte counters) to a list; CUDA events
are resolved and the step record is built once per step, so no hook synchronises with the GPU.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memdoctor.capture import gradnorms, gradscaler, history
from memdoctor.capture.collectors import Collector
from memdoctor.capture.discovery import (
    DiscoveredModel,
    describe_model,
    find_trained_roots,
    optimizer_params,
    storage_key,
    storage_nbytes,
)
from memdoctor.capture.stepbuild import Sample, StepData, build_step
from memdoctor.device import Device, default_device
from memdoctor.trace import StepRecord

Sink = Callable[[dict[str, Any]], None]
# An optimizer of the training step that has not stepped for this many optimizer steps is no longer one
# (see ProfileSession._note_optimizer); well above a WGAN's 5-10 critic steps per generator step.
_STALE_AFTER = 32


class _Frame:
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


_NO_PTRS: frozenset[int] = frozenset()


class ProfileSession:
    """Profile a training loop in this process.

    ``with ProfileSession(steps=5) as s: train()`` records ``warmup + steps`` optimizer steps; step
    records go to ``sink`` as they complete, and ``on_done`` is called once the last requested step is
    recorded (the supervised runner stops the script there).
    """

    def __init__(
        self,
        *,
        steps: int = 5,
        warmup: int = 1,
        sink: Sink | None = None,
        device: Device | None = None,
        on_done: Callable[[], None] | None = None,
        time_depth: int | None = None,
        timed_calls_budget: int = 96,
        detail: str = "auto",
        collectors: list[Collector] | None = None,
    ) -> None:
        self.steps = steps
        # Instruments beyond the ledger (memdoctor.capture.collectors); those that want module calls
        # are called from the module hooks of detailed steps.
        self.collectors: list[Collector] = list(collectors or [])
        self._mod_collectors: tuple[Collector, ...] = tuple(c for c in self.collectors if c.wants_modules)
        self._opt_notified = -1
        self.warmup = warmup
        self.sink: Sink = sink or (lambda rec: None)
        self.device = device or default_device()
        # Which tensors the ledger counts: those on the profiled device (None: all of them, a CPU
        # session). Offload keeps optimizer state, and chosen parameters and their gradients, on the
        # host; the allocator does not hold them, so neither may the ledger's categories.
        self._resident = resident_check(self.device)
        self.on_done = on_done or self.stop
        # Modules called deeper than time_depth keep their memory accounting but get no timing sample
        # (a CUDA event costs ~14 us of host time); None picks the depth after the first step so that
        # at most timed_calls_budget module calls a forward are timed.
        self.time_depth = time_depth
        self._auto_depth = time_depth is None
        self.timed_calls_budget = timed_calls_budget
        self._calls_at_depth: dict[int, int] = {}
        self._pending: list[tuple[object, int, bool]] = []
        # The allocator's history is recorded for the first step and the first and last profiled steps
        # (CUDA only).
        self._history = (
            history.HistoryRecorder() if history.available() and self.device.kind == "cuda" else None
        )
        # Step 0 too: a script that runs out of memory usually does so in its first step.
        self._history_steps = {0, warmup, warmup + steps - 1}
        # Which steps get the full per-module ledger. On CUDA ("auto"): the warm-up steps and the first
        # and last profiled steps; the steps between are timing steps, with only the optimizer hooks
        # and the allocator's peak, so their step times are those of the script without memdoctor's
        # per-module work. On a CPU there is no allocator peak, so every step is detailed.
        self._detail_steps: set[int] | None = None
        if detail != "all" and self.device.has_allocator:
            self._detail_steps = set(range(warmup)) | {warmup, warmup + steps - 1}
        self._module_handles: list[Any] = []
        self.models: list[DiscoveredModel] = []
        self.records: list[StepRecord] = []
        self._index: dict[int, tuple[int, int]] = {}
        self._known_opts: set[int] = set()
        self._optimizers: list[torch.optim.Optimizer] = []
        # Which optimizers make one training step (see _note_optimizer): learned, None until known.
        self._cycle: frozenset[int] | None = None
        self._since_cycle: list[int] = []  # optimizers stepped since the cycle was last seen to start
        self._cycle_last: int | None = None  # the optimizer that steps last in a training step
        self._opt_count = 0  # optimizer steps so far, and the count at each optimizer's last step
        self._last_step_at: dict[int, int] = {}
        self._first_step_at: dict[int, int] = {}
        self._stepped: set[int] = set()  # optimizers stepped in the step in progress
        self._handles: list[Any] = []
        self._saved_ctx: Any = None
        self._param_ptrs: dict[int, int] = {}  # storage address -> bytes, of known parameters on the device
        # id(parameter) -> whether it lives on the profiled device, as seen outside optimizer steps
        # (inside one, an offloaded optimizer has swapped its parameters to host copies).
        self._home: dict[int, bool] = {}
        self._in_opt = False  # between the optimizer step's pre and post hooks
        self._params_stale = False  # parameters to recount once the optimizer step is over
        self._opt_cache: tuple[Any, ...] | None = None
        self._roots_seen: set[int] = set()
        # (parameter, (model, module index)) of every discovered model, for the per-step scans.
        self._flat_params: list[tuple[torch.Tensor, tuple[int, int]]] = []
        self._grads_counted: set[int] = set()
        # id(parameter) -> (storage address, bytes) of its device gradient, as the gradient hook saw it
        self._grad_at: dict[int, tuple[int, int]] = {}
        self._root_modules: list[nn.Module] = []
        self._param_handles: list[Any] = []
        self._stack: list[_Frame] = []
        self._fault_at: int | None = None  # id() of the innermost module an exception escaped
        self._saved: dict[int, tuple[int, Any]] = {}
        self._act_live = 0
        self._grads_live = 0
        self._opt_bytes = 0
        self._params_bytes = 0
        self._step_index = 0
        self._done = False
        self._running = False
        self._scaler = gradscaler.ScalerWatch(
            self._scaler_step, self._scaler_skipped, lambda: self._opt_count
        )
        self._new_step(first=True)

    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ProfileSession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def start(self) -> None:
        if self._running:
            return
        self._handles = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._scaler.install()
        if self.detailed(0):
            self._module_hooks(True)
        self._running = True
        for c in list(self.collectors):
            self._call(c, "start", self)
        self._notify_step_start()
        self._data.t0_unix = time.time()
        self._start_history()
        self._sample("step_start", None, 0)

    def stop(self) -> None:
        """Remove every hook this session installed. Safe to call twice."""
        for handle in self._handles + self._param_handles:
            handle.remove()
        self._handles, self._param_handles = [], []
        self._scaler.remove()
        self._module_hooks(False)
        if self._running:
            for c in self.collectors:
                with contextlib.suppress(Exception):  # one failing teardown must not stop the others'
                    c.stop()
        self._running = False

    def detailed(self, step: int) -> bool:
        """Whether ``step`` records the per-module ledger (else it is a timing step)."""
        return self._detail_steps is None or step in self._detail_steps

    def _module_hooks(self, on: bool) -> None:
        """Install or remove the module, saved-tensor and gradient hooks (only ever between steps).

        Timing steps run without the per-parameter gradient hooks too: ~200 Python calls a backward on
        BERT-base; their gradients are counted once, at the optimizer step, instead."""
        if on and not self._param_handles and self._running:
            for model in self.models:
                self._watch_grads(model)
        elif not on and self._param_handles:
            for handle in self._param_handles:
                handle.remove()
            self._param_handles = []
        if on and not self._module_handles:
            mod = torch.nn.modules.module
            # always_call (torch >= 2.0): the post hook also runs when the forward raises, so the
            # module stack unwinds with the exception (a script that catches it, or non-reentrant
            # activation checkpointing, which stops its recomputation by raising, would otherwise
            # leave frames behind and every later forward would look nested).
            self._module_handles = [
                mod.register_module_forward_pre_hook(self._fwd_pre),
                mod.register_module_forward_hook(self._fwd_post, always_call=True),
            ]
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_ctx.__enter__()
        elif not on and self._module_handles:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles = []
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(None, None, None)
                self._saved_ctx = None

    def finish(self) -> None:
        """Record the step in progress if it ended with an optimizer step, then stop."""
        if self._running and self._data.opt_posts and not self._done:
            self._finalize_step()
        self._emit_ready(wait=True)
        self.stop()

    def flush_partial(self) -> StepRecord | None:
        """Write what the step in progress measured so far, marked incomplete (the script is dying)."""
        self._emit_ready(wait=True)
        self._stop_history(self._data)
        if not (self._roots_seen or self._known_opts):
            return None  # no forward, no optimizer step: no step began, and a record would show 0 B
        self._fault_sample()
        if len(self._data.samples) < 2:
            return None
        rec = self._emit(complete=False, upto=len(self._data.samples))
        return rec

    def _fault_sample(self) -> None:
        """A last sample at the fault: the allocator's high-water mark now, with the tensor accounting
        of the last sample before the fault (unwinding the exception has freed tensors since)."""
        samples = self._data.samples
        if not samples:
            return
        last = samples[-1]
        mem = self.device.memory() if self.device.has_allocator else None
        samples.append(last._replace(marker=self.device.marker(), event="fault", depth=0, mem=mem))

    @property
    def steps_recorded(self) -> int:
        return len(self.records)

    def where(self) -> dict[str, Any]:
        """Where the script is now: step, phase, innermost module (for fault reports)."""
        self.discover_seen()
        key = self._stack[-1].key if self._stack else None
        if key is None and self._fault_at is not None:
            key = self._fault_at  # the innermost module an exception escaped (see _unwound)
        if key is None and self._data.samples:
            key = self._data.samples[-1].key
        loc = self._index.get(key) if key is not None else None
        name = None
        if loc is not None:
            name = self.models[loc[0]].info.names[loc[1]]
        started = bool(self._roots_seen or self._known_opts)
        return {
            # Between steps (loading the next batch) the script is in the next step already; before any
            # forward or optimizer step (importing, building the model) it is in no step yet.
            "step": self.current_step() if started else None,
            "phase": self.current_phase() if started else "other",
            "model": loc[0] if loc else None,
            "module": loc[1] if loc else None,
            "module_name": name,
        }

    # ------------------------------------------------------------------------------ for collectors
    def current_step(self) -> int:
        """The step the script is in now: after a step's optimizer step (data loading for the next
        step, say) that is already the next step, as it is in the step records."""
        return self._step_index + (1 if self._data.opt_posts and self._cycle_done() else 0)

    def current_phase(self) -> str:
        """``forward``, ``backward``, ``optimizer`` or ``other`` (between steps: data loading, logging)."""
        return "other" if self._data.opt_posts and self._cycle_done() else self._data.phase

    def current_module(self) -> tuple[int, int] | None:
        """``(model, module index)`` of the innermost module running forward, if known."""
        return self._index.get(self._stack[-1].key) if self._stack else None

    def micro_batches(self) -> int:
        """Forward passes (micro-batches) the step in progress has run so far; counted on steps that
        record the per-module ledger only (0 on timing steps)."""
        return self._data.forwards

    def locate(self, key: int) -> tuple[int, int] | None:
        """``(model, module index)`` of the module with ``id(module) == key`` (None until discovered)."""
        return self._index.get(key)

    def module_count(self, model: int) -> int:
        """How many modules model ``model``'s module table has (for per-module columns)."""
        return len(self.models[model].modules) if 0 <= model < len(self.models) else 0

    def emit(self, name: str, data: dict[str, Any]) -> None:
        """Write a ``collector`` record: facts about the whole run (a later one of the same name
        replaces an earlier one when the trace is read)."""
        self.sink({"type": "collector", "name": name, "data": data})

    def _call(self, c: Collector, method: str, *args: Any) -> Any:
        try:
            return getattr(c, method)(*args)
        except Exception as exc:  # an instrument's failure must not fail the script
            self._collector_failed(c, exc)
            return None

    def _collector_failed(self, c: Collector, exc: BaseException) -> None:
        """Switch a failing collector off, say so in the trace, and carry on profiling."""
        if c not in self.collectors:
            return
        self.collectors.remove(c)
        self._mod_collectors = tuple(x for x in self._mod_collectors if x is not c)
        with contextlib.suppress(Exception):
            c.stop()
        msg = f"the {c.name} collector failed and was switched off: {type(exc).__name__}: {exc}"
        self.sink({"type": "event", "kind": "collector_failed", "message": msg[:400]})

    def _notify_step_start(self) -> None:
        step, detailed = self._step_index, self.detailed(self._step_index)
        for c in list(self.collectors):
            self._call(c, "on_step_start", step, detailed)

    # ------------------------------------------------------------------------------ module hooks
    def _fwd_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # Hot path: runs for every module call. Deep (untimed) modules only keep the stack for the
        # saved-tensor attribution.
        stack = self._stack
        depth = len(stack)
        if depth == 0:
            if not torch.is_grad_enabled():
                stack.append(_Frame(id(module), -1, 0, _NO_PTRS, active=False))
                return
            if _in_backward():
                # Activation checkpointing recomputing a forward inside backward: not a new
                # micro-batch, and its time is the backward's. (Non-reentrant checkpointing stops the
                # recomputation early by raising; the always_call post hook unwinds these frames.)
                stack.append(_Frame(id(module), -1, 0, _NO_PTRS, active=False, recompute=True))
                if self._mod_collectors:  # collectors see recomputations (NVTX, FLOPs do)
                    self._collect_fwd_pre(module, depth, False)
                return
            self._root_call(module)
        elif not stack[-1].active:
            recompute = stack[-1].recompute
            stack.append(_Frame(id(module), -1, 0, _NO_PTRS, active=False, recompute=recompute))
            if recompute and self._mod_collectors:
                self._collect_fwd_pre(module, depth, False)
            return
        if self._auto_depth and self._step_index == 0:
            self._calls_at_depth[depth] = self._calls_at_depth.get(depth, 0) + 1
        if self.time_depth is not None and depth > self.time_depth:
            stack.append(_Frame(id(module), -1, self._data.saved_total, _NO_PTRS))
            if self._mod_collectors:
                self._collect_fwd_pre(module, depth, False)
            return
        if self._mod_collectors:
            self._collect_fwd_pre(module, depth, True)
        stack.append(_Frame(id(module), len(self._data.samples), self._data.saved_total, _input_ptrs(args)))
        first = _first_grad_tensor(args)
        if first is not None:
            first.register_hook(_TensorHook(self, "bwd_post", id(module), depth))
        self._sample("fwd_pre", id(module), depth)

    def _fwd_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if output is None:
            exc = sys.exc_info()[0]
            if exc is not None:  # the forward raised: torch calls always_call hooks with None
                self._unwound(module, exc)
                return
        stack = self._stack
        key = id(module)
        frame = stack.pop() if stack and stack[-1].key == key else self._pop_frame(key)
        if frame is None or not frame.active:
            if frame is not None and frame.recompute and self._mod_collectors:
                self._collect_fwd_post(module, output, len(stack), False)
            return
        incl = self._data.saved_total - frame.saved_at_pre
        acc = self._data.micro.get(key)
        if acc is None:
            acc = self._data.micro[key] = [0, 0, 0]
        acc[0] += incl
        acc[2] += 1
        if self._mod_collectors:
            self._collect_fwd_post(module, output, len(stack), frame.sample >= 0)
        if frame.sample < 0:
            acc[1] = None  # not measured for untimed modules: their inputs were not recorded
            return
        if acc[1] is not None:
            acc[1] += incl - frame.input_saved
        out = _first_grad_tensor(output)
        if out is not None:
            out.register_hook(_TensorHook(self, "bwd_pre", key, len(stack)))
        i = self._sample("fwd_post", key, len(stack))
        self._data.fwd_pairs.append((key, frame.sample, i))
        if not stack and self._pending:
            # The forward's kernels are queued: building the last step's record now overlaps them.
            self._emit_ready(wait=False)

    def _collect_fwd_pre(self, module: nn.Module, depth: int, timed: bool) -> None:
        for c in self._mod_collectors:
            try:
                c.on_forward_pre(id(module), module, depth, timed)
            except Exception as exc:
                self._collector_failed(c, exc)

    def _collect_fwd_post(self, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        for c in self._mod_collectors:
            try:
                c.on_forward_post(id(module), module, output, depth, timed)
            except Exception as exc:
                self._collector_failed(c, exc)

    def _unwound(self, module: nn.Module, exc: type[BaseException]) -> None:
        """An exception escaped ``module``'s forward: pop its frame, and remember the innermost such
        module as where the script was (not for checkpointing's own early stop of a recomputation)."""
        key = id(module)
        if self._fault_at is None and "StopRecomputation" not in exc.__name__:
            self._fault_at = key
        frame = self._pop_frame(key)
        if frame is not None and (frame.active or frame.recompute) and self._mod_collectors:
            self._collect_fwd_post(module, None, len(self._stack), False)

    def _pop_frame(self, key: int) -> _Frame | None:
        # An exception inside a child skips its post hook: unwind to the frame of this module.
        while self._stack:
            frame = self._stack.pop()
            if frame.key == key:
                return frame
        return None

    def _root_call(self, module: nn.Module) -> None:
        self._fault_at = None  # an exception the script caught is history now
        self._in_opt = False  # a forward runs outside any optimizer step (one that raised never ended)
        data = self._data
        if data.opt_posts and data.forwards and self._cycle_done():
            self._finalize_step()
            data = self._data
        if self._pending:
            # The finished step goes to disk before the script runs on, so a hard crash keeps it.
            self._emit_ready(wait=False)
        if self._done:
            return
        new_root = id(module) not in self._roots_seen
        if new_root:
            self._roots_seen.add(id(module))
            self._root_modules.append(module)
        if new_root or self._params_stale or (not data.forwards and self.detailed(self._step_index)):
            # Recounted at each ledger step's first forward (not on timing steps, whose hot path this
            # is): parameters moved (offloaded, or back) since count where they are now.
            self._note_params()
        # A new micro-batch starts with the step's first top-level call, or the first one after a
        # backward; further top-level calls (a loss module called outside forward) join it.
        if data.forwards and not data.bwd_since_fwd:
            return
        if data.forwards and data.micro:
            data.fold_micro()
        if not data.forwards:
            self._grads_live = self._count_grads()
            self._grads_counted = {id(p) for p, _ in self._flat_params if p.grad is not None}
            self._grad_at = {}
        data.forwards += 1
        data.bwd_since_fwd = False

    def _note_params(self) -> None:
        """Count the parameters of every model seen that live on the profiled device.

        Never inside an optimizer step: an offloaded optimizer steps host copies swapped into
        ``p.data`` there, which are not the device's parameters; the count waits for the next forward."""
        if self._in_opt:
            self._params_stale = True
            return
        self._params_stale = False
        ptrs: dict[int, int] = {}
        home: dict[int, bool] = {}
        roots = {id(r): r for r in [*self._root_modules, *(m.modules[0] for m in self.models)]}
        for root in roots.values():
            for p in root.parameters():
                here = home[id(p)] = self._on_device(p)
                if here:
                    ptrs.setdefault(storage_key(p), storage_nbytes(p))
        # A new dict: the records of finished steps still being built keep the one they were made with.
        self._param_ptrs, self._home = ptrs, home
        self._params_bytes = sum(ptrs.values())

    def _on_device(self, t: torch.Tensor) -> bool:
        return self._resident is None or self._resident(t)

    def _device_grad(self, p: torch.Tensor) -> tuple[int | None, int]:
        """(storage address, bytes) of ``p``'s gradient on the profiled device; (None, 0) without one.

        A parameter that lives on the device but whose data is on the host now is being stepped on the
        host (``memdoctor.levers.offload.OptimizerOffload`` swaps ``p.data`` and ``p.grad`` to host
        copies for the optimizer's own step): its device gradient is still allocated, held by the
        swap, as large as the host copy that stands in for it; its address is the one the gradient hook
        saw in backward (None on steps without that hook)."""
        g = p.grad
        if g is None:
            return None, 0
        if self._on_device(g):
            return storage_key(g), storage_nbytes(g)
        if self._home.get(id(p), False) and not self._on_device(p):
            return self._grad_at.get(id(p)) or (None, g.numel() * g.element_size())
        return None, 0

    def on_backward(self, event: str, key: int, depth: int, grad: Any = None) -> None:
        """Called from tensor hooks, on autograd's thread, as a module's backward starts or ends."""
        data = self._data
        data.bwd_since_fwd = True
        for c in self._mod_collectors:
            try:
                c.on_backward(event, key, depth, grad)
            except Exception as exc:
                self._collector_failed(c, exc)
        i = self._sample(event, key, depth)
        if event == "bwd_pre":
            data.bwd_open.setdefault(key, []).append(i)
            return
        starts = data.bwd_open.get(key)
        if starts:
            data.bwd_pairs.append((key, starts.pop(0), i))

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (``register_post_accumulate_grad_hook``)."""
        order = self._data.grad_order  # backward order, for the first module with a NaN/Inf gradient
        if id(param) not in order:
            order[id(param)] = len(order)
        grad = param.grad
        if id(param) not in self._grads_counted and grad is not None and self._on_device(grad):
            self._grads_counted.add(id(param))
            at = self._grad_at[id(param)] = (storage_key(grad), storage_nbytes(grad))
            self._grads_live += at[1]

    # ------------------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Hot path: every tensor autograd saves. Identity is the storage, so views count once.
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            return t
        ptr = st.data_ptr()
        if ptr in self._saved or ptr in self._param_ptrs or not ptr:
            return t
        if self._resident is not None and not self._resident(t):
            return t  # a host tensor kept for backward: not in the device's memory
        nbytes = st.nbytes()
        self._saved[ptr] = (nbytes, weakref.ref(st, _Freed(self, ptr, nbytes)))
        self._act_live += nbytes
        data = self._data
        data.saved_total += nbytes
        data.saved_ptrs[ptr] = nbytes
        stack = self._stack
        if stack:
            top = stack[-1].key
            data.act_self[top] = data.act_self.get(top, 0) + nbytes
            for frame in stack:
                if ptr in frame.input_ptrs:
                    frame.input_saved += nbytes
        return t

    def on_freed(self, ptr: int, nbytes: int) -> None:
        entry = self._saved.get(ptr)
        if entry is not None and entry[0] == nbytes:
            del self._saved[ptr]
            self._act_live -= nbytes

    # ------------------------------------------------------------------------------ optimizer hooks
    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._done:
            return
        if self._pending:
            self._emit_ready(wait=False)
        self._fault_at = None
        self._in_opt = True
        if id(opt) not in self._known_opts:
            self._discover(opt)
        self._note_optimizer(id(opt))
        self._sample("opt_pre", None, 0)
        if self._opt_notified != self._step_index:
            self._opt_notified = self._step_index
            for c in list(self.collectors):
                self._call(c, "on_optimizer", self._step_index)
        if not self.detailed(self._step_index):
            self._grads_live = self._count_grads()  # no gradient hooks on timing steps
        else:
            self._data.grad_bytes = self._grads_by_module()
            self._grads_live = sum(self._data.grad_bytes.values())
            if self._data.grad_norms is None:  # the step's first optimizer: no parameter updated yet
                # Launched on the device, never read here: build_step reads them once per step.
                self._data.grad_norms = gradnorms.collect(self._flat_params)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._done:
            return
        self._in_opt = False
        self._data.opt_bytes = self._opt_state_by_module()
        self._sample("opt_post", None, 0)
        self._data.opt_posts += 1
        for c in list(self.collectors):
            self._call(c, "on_optimizer_end", self._step_index)
        now, following = self.detailed(self._step_index), self.detailed(self._step_index + 1)
        if not self._cycle_done(last=id(opt)):
            return  # another optimizer of this training step is still to step (a GAN's generator)
        if not (now and following):
            # The next step's hooks differ from this one's: close the step at its optimizer step and
            # switch the module hooks here, outside any forward.
            self._finalize_step()
            self._module_hooks(following)
            if now:
                self._emit_ready(wait=True)  # a ledger step goes to disk at once (see below)
            return
        # A step with the per-module ledger is written as its optimizer step returns, so that a hard
        # crash right after it keeps it. On CUDA that waits for the step's GPU work: only the
        # warm-up, first and last profiled steps pay this; timing steps are written without waiting.
        self._write_provisional()

    def _scaler_step(self, scale: Any) -> None:
        """A GradScaler is about to step: keep the (device) scale its gradients were multiplied by."""
        if not self._done:
            self._data.scaler_stepped = True
            self._data.loss_scale = scale

    def _scaler_skipped(self, opt: torch.optim.Optimizer) -> None:
        """The GradScaler found Inf/NaN gradients and skipped ``opt.step()``: the training step still
        ends here (forward and backward ran; the script goes on to its next batch), so close it as if
        the optimizer had stepped, marked skipped, instead of merging it into the next step."""
        if self._done:
            return
        self._data.scaler_skipped = True
        self._opt_pre(opt, (), {})
        self._opt_post(opt, (), {})

    def _note_optimizer(self, key: int) -> None:
        """Learn which optimizers make one training step: those that step between two steps of the
        same optimizer. One optimizer is the common case; a GAN steps its discriminator's and then its
        generator's, with a forward between them, and a training step ends only after both.

        The set only grows (a WGAN's critic steps several times between two generator steps: the
        critic alone repeating says nothing about the generator), except that an optimizer leaves it
        when it has not stepped since one of those now stepping first did (a script that moved on to
        another optimizer), or for ``_STALE_AFTER`` optimizer steps, so that steps close again."""
        self._opt_count += 1
        self._first_step_at.setdefault(key, self._opt_count)
        if key in self._since_cycle:
            seen = frozenset(self._since_cycle)
            if self._cycle is None or seen >= self._cycle or self._stale(self._cycle - seen, seen):
                self._cycle, self._cycle_last = seen, self._since_cycle[-1]
            self._since_cycle = []
        self._since_cycle.append(key)
        self._stepped.add(key)
        self._last_step_at[key] = self._opt_count

    def _stale(self, missing: frozenset[int], seen: frozenset[int]) -> bool:
        newest = max(self._first_step_at[k] for k in seen)
        return any(
            self._last_step_at[k] < newest or self._opt_count - self._last_step_at[k] > _STALE_AFTER
            for k in missing
        )

    def _cycle_done(self, last: int | None = None) -> bool:
        """Whether every optimizer of a training step has stepped in the step in progress; with
        ``last`` (the optimizer that just stepped), also whether it is the one that ends the cycle: on
        a timing step the step ends at an optimizer step, and must end after the cycle's last one."""
        if self._cycle is None:
            return True
        return self._cycle <= self._stepped and (last is None or last == self._cycle_last)

    def _set_warmup(self, warmup: int) -> None:
        self.warmup = warmup
        self._history_steps = {0, warmup, warmup + self.steps - 1}
        if self._detail_steps is not None:
            self._detail_steps = set(range(warmup)) | {warmup, warmup + self.steps - 1}

    def _write_provisional(self) -> None:
        """Write the step now, marked complete; if a second optimizer steps before the next forward,
        the step's final record (same step number) replaces this one when the trace is read."""
        data = self._data
        data.fold_micro()
        rec = build_step(
            data,
            upto=len(data.samples),
            device=self.device,
            index=self._index,
            warmup=data.step < self.warmup,
            complete=True,
            param_ptrs=self._param_ptrs,
            release=False,
        )
        self.sink(self._step_record(rec, data))

    def _discover(self, opt: torch.optim.Optimizer) -> None:
        if self._known_opts and self._cycle is None and 0 < self._step_index == self.warmup:
            # A second optimizer that first steps after another's step (a GAN's generator after its
            # discriminator): the steps so far each held a part of a training step, so the first
            # profiled step becomes one more warm-up step, and the profiled steps are whole ones.
            self._set_warmup(self.warmup + 1)
        self._known_opts.add(id(opt))
        self._optimizers.append(opt)
        params = {id(p) for p in optimizer_params(opt)}
        owned = {pid for m in self.models for pid in m.param_owner}
        if params <= owned:
            return
        for root in find_trained_roots(params - owned):
            if any(m.modules[0] is root for m in self.models):
                continue
            self._add_model(describe_model(len(self.models), root, self._optimizers))

    def _add_model(self, model: DiscoveredModel) -> None:
        self.models.append(model)
        for i, mod in enumerate(model.modules):
            self._index.setdefault(id(mod), (model.info.index, i))
            self._flat_params += [(p, (model.info.index, i)) for p in mod.parameters(recurse=False)]
        if self.detailed(self._step_index):
            self._watch_grads(model)
        self._note_params()
        self.sink(model.info.to_record())
        for c in list(self.collectors):
            self._call(c, "on_model", model.info.index, model.modules[0])

    def _watch_grads(self, model: DiscoveredModel) -> None:
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return  # torch < 2.1: gradients are measured at the optimizer step only
        seen: set[int] = set()
        for mod in model.modules:
            for p in mod.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._param_handles.append(p.register_post_accumulate_grad_hook(_GradHook(self)))

    def discover_seen(self) -> None:
        """Describe the top-level modules seen so far as models (for a fault before any optimizer step)."""
        if self.models:
            return
        for root in self._root_modules:
            model = describe_model(len(self.models), root, self._optimizers)
            self._add_model(model)

    def _grads_by_module(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        seen: dict[int, int] = {}  # storage address -> bytes, of the gradients on the device
        for p, loc in self._flat_params:
            if p.grad is None:
                continue
            key, n = self._device_grad(p)
            if n and (key is None or key not in seen):
                out[loc] = out.get(loc, 0) + n
                if key is not None:
                    seen[key] = n
        self._data.grad_ptrs = seen
        return out

    def _count_grads(self) -> int:
        return sum(self._device_grad(p)[1] for p, _ in self._flat_params if p.grad is not None)

    def _opt_state_by_module(self) -> dict[tuple[int, int], int]:
        # Optimizer state is created once and updated in place: rescan only when it grows or moves
        # (offload moves state a checkpoint loaded onto the device to the host at its first step).
        shape = tuple((id(o), len(o.state), self._state_where(o)) for o in self._optimizers)
        if self._opt_cache is None or self._opt_cache[0] != shape:
            self._opt_cache = (shape, *self._scan_opt_state())
        _, out, total, seen = self._opt_cache
        self._opt_bytes = total
        self._data.opt_ptrs = seen
        return out

    def _scan_opt_state(self) -> tuple[dict[tuple[int, int], int], int, dict[int, int]]:
        out: dict[tuple[int, int], int] = {}
        seen: dict[int, int] = {}
        for opt in self._optimizers:
            for p, state in opt.state.items():
                loc = self._owner_of(p)
                for v in state.values() if isinstance(state, dict) else ():
                    # Only state on the profiled device: not AdamW's step counters, which it keeps on the
                    # host, nor the state an offloaded optimizer keeps there (this scan may run inside
                    # its step, where the parameters themselves are host copies). On a CPU session
                    # everything is on the device, as the state is.
                    if not isinstance(v, torch.Tensor) or not self._on_device(v):
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
                    return self._on_device(v)
            return None
        return None

    def _owner_of(self, p: Any) -> tuple[int, int] | None:
        for model in self.models:
            i = model.param_owner.get(id(p))
            if i is not None:
                return (model.info.index, i)
        return None

    # ------------------------------------------------------------------------------ samples and steps
    def _sample(self, event: str, key: int | None, depth: int) -> int:
        data = self._data
        mem = None
        # The allocator's figures cost ~150 us a read on CUDA: read them at step, root-forward,
        # top-level backward and optimizer boundaries only; the step's true peak comes from
        # max_memory_allocated.
        if self.device.has_allocator and (depth == 0 or (depth == 1 and event[0] == "b")):
            mem = self.device.memory()
        data.samples.append(
            Sample(
                self.device.marker(),
                event,
                key,
                depth,
                self._params_bytes,
                self._grads_live,
                self._opt_bytes,
                self._act_live,
                mem,
            )
        )
        if event == "bwd_pre" or event == "bwd_post":
            data.phase = "backward"
        elif event == "fwd_pre" and depth == 0:
            data.phase = "forward"
        elif event == "opt_pre":
            data.phase = "optimizer"
        return len(data.samples) - 1

    def _new_step(self, first: bool = False, carry: list[Sample] | None = None) -> None:
        self._data = StepData(step=self._step_index)
        self._stepped = set()
        if not first:
            self.device.reset_peak()
            self._start_history()
            self._notify_step_start()
        if carry:
            self._data.samples.extend(carry)

    def _start_history(self) -> None:
        if self._history is None or self._step_index not in self._history_steps:
            return
        mem = self.device.memory()
        self._data.history_baseline = mem[0] if mem else 0
        self._history.start()

    def _stop_history(self, data: StepData) -> None:
        if self._history is not None and self._history.active:
            data.history = self._history.stop()

    def _finalize_step(self) -> None:
        data = self._data
        upto = data.last_opt_post_index() + 1
        carry = data.samples[upto:]
        self._stop_history(data)
        self._pending.append((data, upto, True))
        if self._auto_depth and self._step_index == 0:
            self.time_depth = _pick_depth(self._calls_at_depth, self.timed_calls_budget)
        self._step_index += 1
        t_start = data.samples[upto - 1] if upto else None
        self._new_step(carry=[t_start, *carry] if t_start is not None else carry)
        if self._step_index >= self.warmup + self.steps and not self._done:
            self._done = True
            self._emit_ready(wait=True)
            if self.on_done is not None:
                self.on_done()

    def _emit_ready(self, *, wait: bool) -> None:
        """Write finished steps whose GPU work is done; with wait=True, all of them (synchronising).

        Resolving a step's CUDA events waits for the GPU, so it is deferred until the events have
        completed: the script keeps running ahead of the GPU as it does without memdoctor."""
        while self._pending:
            data, upto, complete = self._pending[0]
            if not wait and not self.device.ready(data.samples[upto - 1].marker):  # type: ignore[attr-defined]
                return
            self._pending.pop(0)
            self._emit(complete=complete, upto=upto, data=data)  # type: ignore[arg-type]

    def _emit(self, *, complete: bool, upto: int, data: StepData | None = None) -> StepRecord:
        data = data or self._data
        data.fold_micro()
        rec = build_step(
            data,
            upto=upto,
            device=self.device,
            index=self._index,
            warmup=data.step < self.warmup,
            complete=complete,
            param_ptrs=self._param_ptrs,
            detailed=self.detailed(data.step),
        )
        self.records.append(rec)
        self.sink(self._step_record(rec, data))
        return rec

    def _step_record(self, rec: StepRecord, data: StepData) -> dict[str, Any]:
        """The step's trace record, with its gradient-norm summary (``grad_norm``, null where not
        measured) and what the collectors measured (``collectors``, extra ``modules`` columns)."""
        out = rec.to_record()
        out["grad_norm"] = data.grad_norm_field
        if data.scaler_stepped:  # the step's GPU work is done here: reading the scale does not stall
            scale = gradscaler.read_scale(data.loss_scale)
            out["grad_scaler"] = {"scale": scale, "skipped": data.scaler_skipped}
        fields: dict[str, Any] = {}
        for c in list(self.collectors):
            value = self._call(c, "step_field", rec.step)
            if value is not None:
                fields[c.name] = value
            cols = self._call(c, "module_columns", rec.step) or {}
            for model, extra in cols.items():
                target = out["modules"].get(str(model))
                if target is not None:
                    target.update(extra)
        if fields:
            out["collectors"] = fields
        return out


class _TensorHook:
    """A tensor hook that reports a module's backward start or end to the session."""

    __slots__ = ("depth", "event", "key", "session")

    def __init__(self, session: ProfileSession, event: str, key: int, depth: int) -> None:
        self.session, self.event, self.key, self.depth = session, event, key, depth

    def __call__(self, grad: torch.Tensor) -> None:
        if self.session._running:
            self.session.on_backward(self.event, self.key, self.depth, grad)


class _GradHook:
    """Post-accumulate-grad hook: counts a parameter's gradient the moment it exists."""

    __slots__ = ("session",)

    def __init__(self, session: ProfileSession) -> None:
        self.session = session

    def __call__(self, param: torch.Tensor) -> None:
        if self.session._running:
            self.session.on_grad(param)


class _Freed:
    """Weak-reference callback: a saved storage was freed."""

    __slots__ = ("nbytes", "ptr", "session")

    def __init__(self, session: ProfileSession, ptr: int, nbytes: int) -> None:
        self.session, self.ptr, self.nbytes = session, ptr, nbytes

    def __call__(self, _ref: Any) -> None:
        self.session.on_freed(self.ptr, self.nbytes)


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


def _pick_depth(calls_at_depth: dict[int, int], budget: int) -> int:
    """The deepest call depth at which timing every module call stays within budget calls a forward."""
    total, depth = 0, 0
    for d in sorted(calls_at_depth):
        total += calls_at_depth[d]
        if total > budget and d > 0:
            break
        depth = d
    return depth


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (private binding, feature-checked;
    without it, recomputed forwards count as forwards, as before)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _first_grad_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor in a module's inputs or outputs that takes part in autograd."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    if depth > 2:
        return None
    items: Any = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        found = _first_grad_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def _input_ptrs(args: tuple[Any, ...]) -> frozenset[int]:
    ptrs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            try:
                ptrs.append(a.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
    return frozenset(ptrs)
