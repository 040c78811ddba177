"""FLOPs and bytes moved per step and per module: the "compute intensity" axis.

One step is measured, under a ``TorchDispatchMode`` that sees every aten op: the last warm-up step (its
time is not reported), or the first profiled step with ``--warmup 0``. A dispatch mode costs Python time
on every op, so that step's time is perturbed; its record says so (``perturbed: true``) and a
``collector`` record names it up front, so the analysis and the overhead benchmark leave it out.

* FLOPs come from torch's own counter: the formulas ``torch.utils.flop_counter`` registers per aten op
  (matmuls, convolutions, attention; elementwise ops count zero there, and so here).
* Bytes moved are, per op, the bytes of its tensor inputs and outputs (views move nothing). Kernels that
  fuse several ops move less, so this is an unfused upper bound on memory traffic and the arithmetic
  intensity FLOPs / bytes a lower bound.

Why our own small mode rather than ``FlopCounterMode``'s per-module breakdown: that one installs its own
global module hooks and names modules by its own scheme, counts no bytes, and attributes backward ops
through module-level backward hooks. Here forward ops go to the modules on the session's call stack
(kept from ``on_forward_pre``/``on_forward_post``, by ``id(module)``, because models are only discovered
at the first optimizer step, after a step-0 forward). Backward ops go to the modules whose forward
created the autograd node being run: each node created during the forward is tagged with the module
stack of its op (``Node.register_prehook``/``register_hook``, public API). The session's ``on_backward``
events cannot do this: modules that share an input (query/key/value) all end their backward at once,
when the shared input's gradient is complete, and a module whose input needs no gradient (an embedding)
never ends it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memdoctor.capture.collectors import Collector, CollectorUnavailable
from memdoctor.capture.compiled import in_compiled_call, read_counts
from memdoctor.capture.flopcount import COUNTER, UNKNOWN, CountingMode, Tally, innermost_mode

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession
    from memdoctor.device import Device


def flop_formulas() -> dict[Any, Callable[..., int]] | None:
    """torch's FLOP formulas by aten op packet (those ``register_flop_formula`` added included), or
    None where this torch has no FLOP counter. ``flop_registry`` is the module-level table
    ``FlopCounterMode`` reads; it is not in ``__all__``, hence the feature check."""
    try:
        from torch.utils import flop_counter
    except ImportError:
        return None
    registry = getattr(flop_counter, "flop_registry", None)
    return registry if isinstance(registry, dict) and registry else None


def measured_step(warmup: int) -> int:
    """The step the FLOP counter runs on: the last warm-up step, else the first profiled step."""
    return max(warmup - 1, 0)


class FlopCollector(Collector):
    """FLOPs (torch's counter) and bytes moved in one step, per phase and per module."""

    name = "flops"
    wants_modules = True

    def __init__(self, device: Device | None = None, **_: Any) -> None:
        formulas = flop_formulas()
        if formulas is None:
            raise CollectorUnavailable("this torch has no FLOP counter (torch.utils.flop_counter)")
        self._formulas = formulas
        self._session: ProfileSession | None = None
        self._target = 0
        self._armed = False
        self._mode: CountingMode | None = None
        self._thread = 0
        self._tally: Tally | None = None
        self._field: dict[str, Any] | None = None
        self._frames0 = 0
        self._stale: CountingMode | None = None  # done counting, still on the mode stack (see _pop)

    def start(self, session: ProfileSession) -> None:
        self._session = session
        self._target = measured_step(session.warmup)
        self._frames0 = read_counts()["frames"]  # what dynamo had looked at before this session
        session.emit(self.name, {"measured_step": self._target, "counter": COUNTER})

    def stop(self) -> None:
        self._armed = False
        self._exit(complete=False)

    # -------------------------------------------------------------------- entering and leaving the mode
    def on_step_start(self, step: int, detailed: bool) -> None:
        if self._mode is not None:  # the measured step ended without its optimizer step
            self._exit(complete=False)
        elif self._armed and step > self._target and read_counts()["frames"] > self._frames0:
            self._not_measured()  # the measured step ran no module outside compiled code
        self._armed = step == self._target and self._field is None
        if self._stale is not None:
            self._pop()

    def _enter(self) -> None:
        """Start counting at the measured step's first module call (not at the step's start: data
        loading and the script's own code between steps are not part of the model's work). Not from
        inside a compiled call (``in_compiled_call``): the mode would not survive its return."""
        assert self._session is not None
        self._armed = False
        if in_compiled_call():
            self._not_measured(
                "its first module call ran inside a torch.compile'd function (an eager part of it), where "
                "the counter cannot be entered safely"
            )
            return
        self._tally = Tally()
        self._mode = CountingMode(self._tally, self._formulas, self._session.current_phase)
        self._thread = threading.get_ident()
        self._mode.__enter__()

    def _exit(self, *, complete: bool) -> None:
        """Leave the mode (only from the thread that entered it, and only if it is the innermost mode:
        popping another would remove the script's own) and keep what it counted."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.active = False  # a mode that cannot be popped below passes every op straight through
        self._stale = mode
        self._pop()
        mode.release()
        if self._tally is not None:
            self._field = self._tally.field(self._target, complete and mode.error is None)
            if mode.error is not None:
                self._field["error"] = mode.error

    def _pop(self) -> None:
        """Pop the finished mode off the mode stack, where that is safe; else leave it there, passing
        every op through, until the next module call or step start that runs in eager code.

        Unsafe inside a compiled call (``in_compiled_call``): a ``torch.compile``'d function that
        calls ``optimizer.step()`` runs the optimizer hooks, which end counting, inside it, and a pop
        there crashed the script's next ``optimizer.zero_grad()`` (PythonFallbackKernel internal
        assert). Only from the thread that entered it, and only if it is the innermost mode: popping
        another would remove the script's own."""
        mode = self._stale
        if mode is None or threading.get_ident() != self._thread or in_compiled_call():
            return
        self._stale = None
        if innermost_mode() in (mode, UNKNOWN):
            with contextlib.suppress(Exception):
                mode.__exit__(None, None, None)

    def _not_measured(self, why: str | None = None) -> None:
        """Say in the ``flops`` collector record that the measured step has no FLOP count and why,
        rather than leave the count out silently."""
        self._armed = False
        if self._session is None or self._field is not None:
            return
        why = why or (
            "no module of the trained model ran outside torch.compile'd code in it (memdoctor's hooks "
            "stay out of compiled code, so the counter never started)"
        )
        record = {
            "measured_step": self._target,
            "counter": COUNTER,
            "not_measured": f"step {self._target}: {why}",
        }
        self._session.emit(self.name, record)

    # -------------------------------------------------------------------- session hooks
    def on_forward_pre(self, key: int, module: nn.Module, depth: int, timed: bool) -> None:
        mode = self._mode
        if mode is None:
            if self._stale is not None:
                self._pop()
            if not self._armed:
                return
            self._enter()
            mode = self._mode
            if mode is None:
                return
        mode.enter_module(key)

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        if self._mode is not None:
            self._mode.leave_module(key)

    def on_optimizer_end(self, step: int) -> None:
        # Only the first optimizer of the step is counted: the next step's data loading follows.
        if self._mode is not None:
            self._exit(complete=True)

    def step_field(self, step: int) -> Any:
        if step != self._target:
            return None
        if self._mode is not None:  # the script died in the measured step: keep what was counted
            self._exit(complete=False)
        return self._field

    def module_columns(self, step: int) -> dict[int, dict[str, list[Any]]]:
        if step != self._target or self._tally is None or self._session is None or self._mode is not None:
            return {}
        return module_columns(self._session, self._tally.modules)


def module_columns(session: ProfileSession, per_key: dict[int, list[int]]) -> dict[int, dict[str, list[Any]]]:
    """``flops`` (forward + backward), ``flops_backward`` and ``flop_bytes`` per module, inclusive of
    submodules. A module that was never called itself (a ``ModuleList``) gets its children's sum."""
    located: dict[int, dict[int, list[int]]] = {}
    for key, acc in per_key.items():
        loc = session.locate(key)
        if loc is not None:
            located.setdefault(loc[0], {})[loc[1]] = acc
    out: dict[int, dict[str, list[Any]]] = {}
    for model, accs in located.items():
        parents = session.models[model].info.parents
        rows = [accs.get(i) for i in range(session.module_count(model))]
        flops = _fill_uncalled(parents, [None if r is None else r[0] + r[1] for r in rows])
        bwd = _fill_uncalled(parents, [None if r is None else r[1] for r in rows])
        nbytes = _fill_uncalled(parents, [None if r is None else r[2] + r[3] for r in rows])
        out[model] = {"flops": flops, "flops_backward": bwd, "flop_bytes": nbytes}
    return out


def _fill_uncalled(parents: list[int], values: list[int | None]) -> list[int]:
    """Modules without a value get the sum of their children's (children follow their parent)."""
    sums = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        own = values[i]
        value = own if own is not None else sums[i]
        values[i] = value
        p = parents[i] if i < len(parents) else -1
        if p >= 0:
            sums[p] += value
    return [int(v or 0) for v in values]
