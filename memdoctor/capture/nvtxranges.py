"""NVTX ranges: the model's structure and the step's phases on an Nsight Systems timeline.

Run ``nsys profile memdoctor profile train.py`` and the timeline shows, in the NVTX domain
``memdoctor``:

* ``step N`` for every profiled step, from the end of the previous step's optimizer step (so data
  loading belongs to the step it feeds, as in the trace's step records) to the end of its own;
* the phases ``forward`` (from the first top-level module call), ``backward`` (from the first module's
  backward to the end of the backward pass) and ``optimizer`` (the step's first optimizer step);
* on detailed steps, every module's forward, named by its qualified name (``bert.encoder.layer.3``),
  and the backward of every module down to the session's timing depth (the modules whose backward
  the session observes).

Timing steps run without module hooks, so they get only their ``step`` and ``optimizer`` ranges.

Two kinds of NVTX range are used, each where it is correct:

* forward ranges are push/pop ranges: module calls nest, and they all run on the script's thread.
  Our own stack of keys keeps them balanced when a module raises (its post hook never runs): the
  next post hook, or the next step, pops down to the matching module;
* backward, phase and step ranges are start/end ranges (a handle each), because they cannot be
  push/pop: on CUDA autograd runs the backward on its own thread, and the tensor hooks that mark a
  module's backward fire in registration order, so a parent module's backward would start *after*
  the child that produces the same output tensor and a pop would close the wrong range.

The domain API with an ``EventAttributes`` cached per name costs about 30 ns a range on a CPU,
against about 250 ns for ``nvtx.push_range(message, domain=...)`` (which looks the domain up and
builds the attributes on every call). Without an NVTX tool attached, ``nvtx`` hands out a dummy
domain; the collector then asks for no module calls at all, so it costs nothing.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.capture.collectors import Collector, CollectorUnavailable

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession

DOMAIN = "memdoctor"
# Colours in the Nsight Systems timeline (ARGB), one per kind of range.
_COLORS = {"step": 0xFF76B900, "phase": 0xFF5A8DEE, "forward": 0xFF2B9E8F, "backward": 0xFFE8833A}


def _import_nvtx() -> Any:
    """The ``nvtx`` module, or CollectorUnavailable (it is an optional dependency: memdoctor[gpu])."""
    try:
        import nvtx
    except ImportError:
        raise CollectorUnavailable("nvtx package not installed: pip install nvtx") from None
    return nvtx


def _tool_attached(nvtx: Any, domain: Any) -> bool:
    """Whether an NVTX tool (Nsight Systems) receives the domain's ranges: without one, ``nvtx``
    returns its dummy domain, whose calls do nothing."""
    dummy = getattr(getattr(nvtx, "_lib", None), "DummyDomain", None)
    return dummy is None or not isinstance(domain, dummy)


def _nvtx_version() -> str | None:
    try:
        return importlib.metadata.version("nvtx")
    except importlib.metadata.PackageNotFoundError:
        return None


def _queue_backward_end() -> Any:
    """Autograd's "run this when the backward pass finishes" (``queue_callback`` of the execution
    engine, what DDP and FSDP use); a private API, so looked up behind a check: None where missing,
    and then open backward ranges end at the next forward or optimizer step instead."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return getattr(engine, "queue_callback", None)


class _NoDomain:
    """A domain that emits nothing: what the collector talks to once stopped."""

    def get_event_attributes(self, **_: Any) -> None:
        return None

    def push_range(self, attrs: Any = None) -> None:
        pass

    def pop_range(self) -> None:
        pass

    def start_range(self, attrs: Any = None) -> int:
        return 0

    def end_range(self, handle: Any) -> None:
        pass


class NvtxCollector(Collector):
    """Emits NVTX ranges for steps, phases and module calls; records that it did (``collector``
    record ``nvtx``). The ranges' times are in the trace already (``phases_ms``, ``forward_ms``,
    ``backward_ms``): the point here is the Nsight Systems timeline."""

    name = "nvtx"
    wants_modules = True

    def __init__(self, device: Any = None, **_: Any) -> None:
        self._nvtx = _import_nvtx()
        self._domain = self._nvtx.get_domain(DOMAIN)
        self.attached = _tool_attached(self._nvtx, self._domain)
        # Nothing would receive module ranges: ask the session for no module calls at all.
        self.wants_modules = self.attached
        self._session: ProfileSession | None = None
        self._attrs: dict[tuple[int, str], Any] = {}  # (module key, kind) -> cached EventAttributes
        self._names: dict[int, str] = {}  # module key -> range name
        self._fwd: list[int] = []  # keys of the open push/pop forward ranges, innermost last
        self._bwd: dict[int, list[Any]] = {}  # key -> handles of its open backward ranges, oldest first
        self._phase: tuple[str, Any] | None = None  # (name, handle) of the open phase range
        self._step: tuple[int, Any] | None = None  # (step, handle) of the open step range
        self._in_backward = False
        self._bwd_base = 0  # forward ranges open when the backward pass began
        self._queue_end = _queue_backward_end()

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, session: ProfileSession) -> None:
        self._session = session
        session.emit(self.name, {"emitted": self.attached, "domain": DOMAIN, "version": _nvtx_version()})

    def stop(self) -> None:
        """End every open range (the run stops mid-step, or the script ended). Safe to call twice."""
        if not self.attached:
            return
        self._unwind_forward(None)
        self._end_backward()
        self._set_phase(None)
        if self._step is not None:
            self._domain.end_range(self._step[1])
            self._step = None
        # The session may still finish the module call that ended the run: nothing more is emitted.
        self._domain = _NoDomain()

    def on_model(self, model: int, root: nn.Module) -> None:
        self._attrs.clear()  # modules named by class until now get their qualified names
        self._names.clear()

    # ------------------------------------------------------------------------------ steps and phases
    def on_step_start(self, step: int, detailed: bool) -> None:
        if self.attached and (self._step is None or self._step[0] != step):
            self._set_phase(None)
            self._begin_step(step)

    def on_optimizer(self, step: int) -> None:
        if not self.attached:
            return
        self._unwind_forward(None)
        self._end_backward()
        self._set_phase("optimizer")

    def on_optimizer_end(self, step: int) -> None:
        """The step ends with its first optimizer step (a second optimizer in the same step, as in a
        GAN, falls in the next step's range: which optimizer is the last one is not known here)."""
        if not self.attached or self._step is None or self._step[0] != step:
            return
        self._set_phase(None)
        self._begin_step(step + 1)

    def _begin_step(self, step: int) -> None:
        """End the open step range and open ``step N``, unless N is past the profiled steps."""
        if self._step is not None:
            self._domain.end_range(self._step[1])
            self._step = None
        session = self._session
        if session is not None and step >= session.warmup + session.steps:
            return
        attrs = self._domain.get_event_attributes(
            message=f"step {step}", color=_COLORS["step"], category="step"
        )
        self._step = (step, self._domain.start_range(attrs))

    def _set_phase(self, phase: str | None) -> None:
        """End the open phase range and start ``phase`` (None: no phase, between phases)."""
        current = self._phase
        if current is not None:
            if current[0] == phase:
                return
            self._domain.end_range(current[1])
            self._phase = None
        if phase is not None:
            attrs = self._attrs.get((0, phase))
            if attrs is None:
                attrs = self._attrs[(0, phase)] = self._domain.get_event_attributes(
                    message=phase, color=_COLORS["phase"], category="phase"
                )
            self._phase = (phase, self._domain.start_range(attrs))

    # ------------------------------------------------------------------------------ module calls
    def on_forward_pre(self, key: int, module: nn.Module, depth: int, timed: bool) -> None:
        stack = self._fwd
        # A top-level call: depth 0, or nothing of ours open, or the bottom module called again (the
        # session's depth counts frames left open by a call that raised, ours may too).
        if depth == 0 or not stack or key == stack[0]:
            self._top_level_call()
        elif self._in_backward and len(stack) > self._bwd_base:
            self._recomputation(key)
        attrs = self._attrs.get((key, "forward"))
        if attrs is None:
            attrs = self._module_attrs(key, module, "forward")
        self._domain.push_range(attrs)
        stack.append(key)

    def _top_level_call(self) -> None:
        """A forward pass starts: forward ranges still open belong to a call that raised."""
        if self._in_backward and self._queue_end is not None:
            return  # a checkpointed module recomputed inside the backward pass: still backward
        self._unwind_forward(None)
        self._end_backward()
        self._set_phase("forward")

    def _recomputation(self, key: int) -> None:
        """A module call inside the backward pass (activation checkpointing recomputes a forward):
        pop the ranges of an earlier recomputation that stopped early (none of them encloses this
        module), so that each recomputation's ranges end where the next one begins."""
        enclosing = self._ancestors(key)
        if enclosing is None:
            return  # not a discovered module: its parents are unknown
        stack = self._fwd
        while len(stack) > self._bwd_base and stack[-1] not in enclosing:
            stack.pop()
            self._domain.pop_range()

    def _ancestors(self, key: int) -> set[int] | None:
        """``id`` of every module enclosing the module ``key`` in its model, or None if unknown."""
        session = self._session
        loc = session.locate(key) if session is not None else None
        if loc is None or session is None:
            return None
        model = session.models[loc[0]]
        out: set[int] = set()
        i = model.info.parents[loc[1]]
        while i >= 0:
            out.add(id(model.modules[i]))
            i = model.info.parents[i]
        return out

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        stack = self._fwd
        if stack and stack[-1] == key:
            stack.pop()
            self._domain.pop_range()
        elif key in stack:
            self._unwind_forward(key)

    def on_backward(self, event: str, key: int, depth: int, grad: Any) -> None:
        if not self._in_backward:
            self._backward_begins()
        if event == "bwd_pre":
            attrs = self._attrs.get((key, "backward"))
            if attrs is None:
                attrs = self._module_attrs(key, None, "backward")
            self._bwd.setdefault(key, []).append(self._domain.start_range(attrs))
            return
        open_ = self._bwd.get(key)
        if open_:
            self._domain.end_range(open_.pop(0))

    def _backward_begins(self) -> None:
        """The first backward event of a backward pass: the forward phase ends; the backward phase
        ends when autograd finishes the pass (or, without that callback, at the next phase)."""
        self._in_backward = True
        self._bwd_base = len(self._fwd)
        self._set_phase("backward")
        if self._queue_end is not None:
            try:
                self._queue_end(self._backward_ended)
            except RuntimeError:  # this torch refuses it here: end backward ranges at the next phase
                self._queue_end = None

    def _backward_ended(self) -> None:
        """Autograd's end-of-backward callback (on autograd's thread): close what it left open (the
        backward of modules whose input needs no gradient, such as the model's root, has no end hook)."""
        self._in_backward = False
        # Recomputed forwards (activation checkpointing) stop early, once the tensors the backward
        # needs exist, so their outer modules' post hooks never run: pop them here, on the same
        # thread they were pushed on.
        while len(self._fwd) > self._bwd_base:
            self._fwd.pop()
            self._domain.pop_range()
        self._end_backward()
        if self._phase is not None and self._phase[0] == "backward":
            self._set_phase(None)

    def _end_backward(self) -> None:
        self._in_backward = False
        if self._bwd:
            for handles in self._bwd.values():
                for handle in handles:
                    self._domain.end_range(handle)
            self._bwd = {}

    def _unwind_forward(self, key: int | None) -> None:
        """Pop forward ranges down to and including ``key`` (None: all of them)."""
        stack = self._fwd
        while stack:
            top = stack.pop()
            self._domain.pop_range()
            if top == key:
                return

    def _module_attrs(self, key: int, module: nn.Module | None, kind: str) -> Any:
        attrs = self._domain.get_event_attributes(
            message=self._module_name(key, module), color=_COLORS[kind], category=kind
        )
        self._attrs[(key, kind)] = attrs
        return attrs

    def _module_name(self, key: int, module: nn.Module | None) -> str:
        """The module's qualified name in its model (the root: the model's class); a module not yet
        discovered (the first step's forward) or outside the trained models: its class name."""
        name = self._names.get(key)
        if name is None:
            session = self._session
            loc = session.locate(key) if session is not None else None
            if loc is not None and session is not None:
                info = session.models[loc[0]].info
                name = info.names[loc[1]] or info.cls
            else:
                name = type(module).__name__ if module is not None else "module"
            self._names[key] = name
        return name
