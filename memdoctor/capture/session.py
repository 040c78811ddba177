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

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.backwardsteps import BackwardSteps
from memdoctor.capture.collectives import Collectives
from memdoctor.capture.collectorcalls import CollectorCalls
from memdoctor.capture.collectors import Collector
from memdoctor.capture.discovery import DiscoveredModel, TrainedModels
from memdoctor.capture.engines import Engines
from memdoctor.capture.forwardstack import ForwardStack
from memdoctor.capture.ledger import Ledger
from memdoctor.capture.modulehooks import ModuleHooks
from memdoctor.capture.optimizersteps import OptimizerSteps
from memdoctor.capture.schedule import StepSchedule
from memdoctor.capture.sessionhooks import resident_check
from memdoctor.capture.stepbuild import Sample, StepData
from memdoctor.capture.stepwriter import StepWriter
from memdoctor.device import Device, default_device
from memdoctor.trace import StepRecord

__all__ = ["ProfileSession", "Sink", "resident_check"]
Sink = Callable[[dict[str, Any]], None]


class ProfileSession:
    """Profile a training loop in this process.

    ``with ProfileSession(steps=5) as s: train()`` records ``warmup + steps`` optimizer steps; step
    records go to ``sink`` as they complete, and ``on_done`` is called once the last requested step is
    recorded (the supervised runner stops the script there).

    The session decides when: which step the script is in, when a step ends, what a fault reports.
    Its parts do the rest: ``StepSchedule`` (which steps record what), ``OptimizerSteps`` (the optimizer
    hooks and which optimizers make one step), ``ForwardStack`` and ``ModuleHooks`` (the module hooks),
    ``TrainedModels`` (what is trained), ``Ledger`` (the bytes), ``StepWriter`` (the records) and
    ``CollectorCalls`` (the instruments beyond the ledger).
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
        self.sink: Sink = sink or (lambda rec: None)
        self.device = device or default_device()
        self.on_done = on_done or self.stop
        # Instruments beyond the ledger (memdoctor.capture.collectors); those that want module calls
        # are called from the module hooks of detailed steps.
        self._calls = CollectorCalls(list(collectors or []), self.sink)
        # Modules called deeper than time_depth keep their memory accounting but get no timing sample.
        self._forward = ForwardStack(self, time_depth, timed_calls_budget)
        # Which steps get the full per-module ledger and the allocator's history.
        self._schedule = StepSchedule(warmup, steps, self.device, detail)
        self._hooks = ModuleHooks(self)  # the per-module hooks of detailed steps
        self._found = TrainedModels(self._model_added)
        self.models, self._index = self._found.models, self._found.index  # the same objects, shared
        self._steps = OptimizerSteps(self)  # the optimizer hooks: where steps end
        self._by_backward = BackwardSteps(self)  # where steps end in a script without an optimizer
        self._cycle = self._steps.cycle
        self._step_index = 0
        self._done = False
        self._running = False
        self._data = StepData(step=0)
        # The distributed engines the models run in (DDP's buckets, FSDP2's shards and buffers).
        self._engines = Engines(lambda t: self._ledger.on_device(t), self._found.index, self.emit)
        # Which tensors the ledger counts: those on the profiled device (None: all of them, a CPU
        # session).
        self._ledger = Ledger(
            self.device,
            resident_check(self.device),
            self.models,
            self._found.roots,
            self._found.optimizers,
            self._forward.frames,
            self._data,
            self._engines,
        )
        self._writer = StepWriter(self)
        self._collectives = Collectives(self)  # time and bytes in torch.distributed's collectives
        self._new_step(first=True)

    # ------------------------------------------------------------------------------ the parts' figures
    @property
    def collectors(self) -> list[Collector]:
        return self._calls.all

    @property
    def _mod_collectors(self) -> tuple[Collector, ...]:
        return self._calls.modules

    @property
    def warmup(self) -> int:
        return self._schedule.warmup

    @property
    def records(self) -> list[StepRecord]:
        return self._writer.records

    @property
    def time_depth(self) -> int | None:
        return self._forward.time_depth

    @property
    def _stack(self) -> list[Any]:
        return self._forward.frames

    @property
    def _resident(self) -> Callable[[torch.Tensor], bool] | None:
        return self._ledger.resident

    @_resident.setter
    def _resident(self, check: Callable[[torch.Tensor], bool] | None) -> None:
        self._ledger.resident = check

    # The ledger's figures, read by tests of the ledger through the session.
    _params_bytes = property(lambda self: self._ledger.params_bytes)
    _param_ptrs = property(lambda self: self._ledger.param_ptrs)
    _opt_bytes = property(lambda self: self._ledger.opt_bytes)
    _opt_cache = property(lambda self: self._ledger.opt_cache)

    def _grads_by_module(self) -> dict[tuple[int, int], int]:
        return self._ledger.grads_by_module()

    def _scan_opt_state(self) -> tuple[dict[tuple[int, int], int], int, dict[int, int]]:
        return self._ledger.scan_opt_state()

    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ProfileSession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def start(self) -> None:
        if self._running:
            return
        self._steps.install()
        self._collectives.install()
        if self.detailed(0):
            self._module_hooks(True)
        self._running = True
        self._calls.each("start", self)
        self._notify_step_start()
        self._data.t0_unix = time.time()
        self._schedule.start_history(self._data)
        self._sample("step_start", None, 0)

    def stop(self) -> None:
        """Remove every hook this session installed. Safe to call twice."""
        self._steps.remove()
        self._module_hooks(False)
        self._engines.shards.remove()
        self._collectives.remove()
        if self._running:
            self._calls.stop()
        self._running = False

    def measure_link(self) -> None:
        """Measure the link between the ranks once (``Collectives.measure_link``): where every rank
        arrives together, the requested steps reached or a launcher's clean end of the script; never
        after a fault, where the other ranks may be gone (it would wait for them up to ``link.WAIT_S``)."""
        self._collectives.measure_link()

    def see_saved(self, tensor: torch.Tensor) -> None:
        """A tensor a checkpointed module's forward saves, which the checkpoint drops (its own hook
        replaces the ledger's there): counted as if saved, on steps with the per-module ledger
        (``memdoctor.levers.apply.SeeThrough``: the checkpoint-all re-profile)."""
        if self._hooks.module_handles:
            self._ledger.pack(tensor)

    def detailed(self, step: int) -> bool:
        """Whether ``step`` records the per-module ledger (else it is a timing step)."""
        return self._schedule.detailed(step)

    def _module_hooks(self, on: bool) -> None:
        self._hooks.set(on, self._running)

    def finish(self) -> None:
        """Record the step in progress if it ended with an optimizer step, then stop."""
        if self._running and not self._done and self._by_backward.in_step():
            self._by_backward.close()
        elif self._running and self._data.opt_posts and not self._done:
            self._finalize_step()
        self._emit_ready(wait=True)
        self.stop()

    def flush_partial(self) -> StepRecord | None:
        """Write what the step in progress measured so far, marked incomplete (the script is dying)."""
        self._emit_ready(wait=True)
        self._schedule.stop_history(self._data)
        if not self._found.started():
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
        if key is None and self._forward.fault_at is not None:
            key = self._forward.fault_at  # the innermost module an exception escaped
        if key is None and self._data.samples:
            key = self._data.samples[-1].key
        loc = self._index.get(key) if key is not None else None
        name = None
        if loc is not None:
            name = self.models[loc[0]].info.names[loc[1]]
        started = self._found.started()
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
        return self._step_index + (1 if self._data.opt_posts and self._cycle.done() else 0)

    def current_phase(self) -> str:
        """``forward``, ``backward``, ``optimizer`` or ``other`` (between steps: data loading, logging)."""
        return "other" if self._data.opt_posts and self._cycle.done() else self._data.phase

    def current_module(self) -> tuple[int, int] | None:
        """``(model, module index)`` of the innermost module running forward, if known."""
        return self._index.get(self._stack[-1].key) if self._stack else None

    def micro_batches(self) -> int:
        """Forward passes (micro-batches) the step in progress has run so far; counted on steps that
        record the per-module ledger only (0 on timing steps)."""
        return self._data.forwards

    def compiled_wrapper(self, module: nn.Module) -> nn.Module | None:
        """The ``torch.compile(module)`` wrapper (``OptimizedModule``) the script calls ``module``
        through, once seen, else None: hooks on the wrapper run in eager code, outside the compiled
        forward (``memdoctor.capture.compiled``)."""
        return self._forward.compiled_wrapper(module)

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

    def _notify_step_start(self) -> None:
        self._calls.each("on_step_start", self._step_index, self.detailed(self._step_index))

    def _root_call(self, module: nn.Module) -> None:
        """A top-level module call (from ``ForwardStack.pre``): it may end the step in progress, and it
        may start a new micro-batch."""
        self._forward.fault_at = None  # an exception the script caught is history now
        self._ledger.in_opt = False  # a forward runs outside any optimizer step (one that raised never ended)
        data = self._data
        if data.opt_posts and data.forwards and self._cycle.done():
            self._finalize_step()
            data = self._data
        elif not self._done and self._by_backward.ends_step():
            self._by_backward.close()
            data = self._data
        if self._writer.pending:
            # The finished step goes to disk before the script runs on, so a hard crash keeps it.
            self._emit_ready(wait=False)
        if self._done:
            return
        new_root = self._found.saw_root(module)
        if new_root:
            self._engines.see(module)
        if new_root or self._ledger.params_stale or (not data.forwards and self.detailed(self._step_index)):
            # Recounted at each ledger step's first forward (not on timing steps, whose hot path this
            # is): parameters moved (offloaded, or back) since count where they are now.
            self._ledger.note_params()
        # A new micro-batch starts with the step's first top-level call, or the first one after a
        # backward; further top-level calls (a loss module called outside forward) join it.
        if data.forwards and not data.bwd_since_fwd:
            return
        if data.forwards:
            data.close_backward_pass()
        if data.forwards and data.micro:
            data.fold_micro()
        if not data.forwards:
            self._ledger.first_forward()
        self._by_backward.note_forward()
        data.forwards += 1
        data.bwd_since_fwd = False

    def on_backward(self, event: str, key: int, depth: int, grad: Any = None) -> None:
        """Called from tensor hooks, on autograd's thread, as a module's backward starts or ends."""
        data = self._data
        data.bwd_since_fwd = True
        if self._calls.modules:
            self._calls.backward(event, key, depth, grad)
        i = self._sample(event, key, depth)
        if event == "bwd_pre":
            data.bwd_open.setdefault(key, []).append(i)
            return
        starts = data.bwd_open.get(key)
        if starts:
            data.bwd_pairs.append((key, starts.pop(0), i))

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (``register_post_accumulate_grad_hook``)."""
        self._ledger.on_grad(param)

    def _model_added(self, model: DiscoveredModel) -> None:
        for i, mod in enumerate(model.modules):
            self._ledger.flat_params += [(p, (model.info.index, i)) for p in mod.parameters(recurse=False)]
        if self.detailed(self._step_index):
            self._hooks.watch_grads(model)
        self._ledger.note_params()
        self.sink(model.info.to_record())
        self._engines.see(model.modules[0])
        self._calls.each("on_model", model.info.index, model.modules[0])

    def discover_seen(self) -> None:
        """Describe the top-level modules seen so far as models (for a fault before any optimizer step)."""
        self._found.add_seen()

    # ------------------------------------------------------------------------------ samples and steps
    def _sample(self, event: str, key: int | None, depth: int) -> int:
        return self._ledger.sample(event, key, depth)

    def _new_step(self, first: bool = False, carry: list[Sample] | None = None) -> None:
        self._data = self._ledger.data = StepData(step=self._step_index)
        shards = self._engines.shards
        shards.peak, shards.watching = self._data.sharding_bytes, self.detailed(self._step_index)
        self._cycle.new_step()
        if not first:
            if self._engines.ddps:
                self._engines.poll_ddp()
            self.device.reset_peak()
            self._schedule.start_history(self._data)
            self._notify_step_start()
        if carry:
            self._data.samples.extend(carry)

    def _finalize_step(self) -> None:
        data = self._data
        upto = data.last_opt_post_index() + 1
        carry = data.samples[upto:]
        self._schedule.stop_history(data)
        self._writer.pending.append((data, upto, True))
        if self._step_index == 0:
            self._forward.first_step_done(data.forwards)
        self._step_index += 1
        t_start = data.samples[upto - 1] if upto else None
        self._new_step(carry=[t_start, *carry] if t_start is not None else carry)
        if self._step_index >= self.warmup + self.steps and not self._done:
            self._done = True
            self._emit_ready(wait=True)
            self.measure_link()  # every rank reaches the same step: the link is measured here, once
            if self.on_done is not None:
                self.on_done()

    def _emit_ready(self, *, wait: bool) -> None:
        self._writer.ready(wait=wait)

    def _emit(self, *, complete: bool, upto: int) -> StepRecord:
        return self._writer.write(self._data, complete=complete, upto=upto)
