"""How the session calls its collectors: each call guarded, so an instrument's failure switches that
one collector off (and says so in the trace) instead of failing the user's script."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from memdoctor.capture.collectors import Collector
from memdoctor.units import NOTE_CHARS, clip


class CollectorCalls:
    """The session's collectors (``all``, in start order) and those that get module calls (``modules``)."""

    def __init__(self, collectors: list[Collector], sink: Callable[[dict[str, Any]], None]) -> None:
        self.all: list[Collector] = list(collectors)
        self.modules: tuple[Collector, ...] = tuple(c for c in self.all if c.wants_modules)
        self.sink = sink
        self.off: set[str] = set()  # the session's own measurements switched off by ``guarded``

    def call(self, c: Collector, method: str, *args: Any) -> Any:
        try:
            return getattr(c, method)(*args)
        except Exception as exc:  # an instrument's failure must not fail the script
            self.failed(c, exc)
            return None

    def each(self, method: str, *args: Any) -> None:
        """``method(*args)`` on every collector still on (a failing one drops out as the loop runs)."""
        for c in list(self.all):
            self.call(c, method, *args)

    def stop(self) -> None:
        for c in self.all:
            with contextlib.suppress(Exception):  # one failing teardown must not stop the others'
                c.stop()

    def failed(self, c: Collector, exc: BaseException) -> None:
        """Switch a failing collector off, say so in the trace, and carry on profiling."""
        if c not in self.all:
            return
        self.all.remove(c)
        self.modules = tuple(x for x in self.modules if x is not c)
        with contextlib.suppress(Exception):
            c.stop()
        msg = f"the {c.name} collector failed and was switched off: {type(exc).__name__}: {exc}"
        self.sink({"type": "event", "kind": "collector_failed", "message": clip(msg, NOTE_CHARS)})

    def guarded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` for a measurement the session makes itself inside a script's call (gradient
        norms in ``optimizer.step()``): a failure switches ``what`` off for the rest of the run, says so
        in the trace and returns None, instead of raising out of the script's call as its own error."""
        if what in self.off:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self.off.add(what)
            msg = f"{what}: memdoctor's measurement failed and was switched off: {type(exc).__name__}: {exc}"
            self.sink({"type": "event", "kind": "collector_failed", "message": clip(msg, NOTE_CHARS)})
            return None

    # ------------------------------------------------------------------------------ module calls (hot)
    def forward_pre(self, module: nn.Module, depth: int, timed: bool) -> None:
        for c in self.modules:
            try:
                c.on_forward_pre(id(module), module, depth, timed)
            except Exception as exc:
                self.failed(c, exc)

    def forward_post(self, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        for c in self.modules:
            try:
                c.on_forward_post(id(module), module, output, depth, timed)
            except Exception as exc:
                self.failed(c, exc)

    def backward(self, event: str, key: int, depth: int, grad: Any) -> None:
        for c in self.modules:
            try:
                c.on_backward(event, key, depth, grad)
            except Exception as exc:
                self.failed(c, exc)

    def step_fields(self, step: int, modules: dict[str, Any]) -> dict[str, Any]:
        """Every collector's ``step_field`` for ``step`` (by name), its ``module_columns`` merged into
        the record's ``modules``."""
        fields: dict[str, Any] = {}
        for c in list(self.all):
            value = self.call(c, "step_field", step)
            if value is not None:
                fields[c.name] = value
            cols = self.call(c, "module_columns", step) or {}
            for model, extra in cols.items():
                target = modules.get(str(model))
                if target is not None:
                    target.update(extra)
        return fields
