"""A trace as pandas DataFrames, for notebooks and pipelines: ``memdoctor.load(TRACE)``.

    import memdoctor

    run = memdoctor.load("memdoctor-report/trace.jsonl.gz")
    run.ledger.nlargest(10, "activations")[["name", "activations", "parameters"]]
    run.timeline.plot(x="time_ms", y=["parameters", "gradients", "optimizer_state", "activations"])

The trace is read once, when ``load`` is called (a bad file fails there, with the ``TraceError`` every
command gives); each frame is built from it the first time it is asked for and then kept. The figures
are the ones ``summary.json`` and the report show, from the same analysis functions
(``docs/notebook.md`` lists the columns). pandas is imported only here, so ``import memdoctor`` does
not need it.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import TYPE_CHECKING, Any

from memdoctor.analysis.faults import event_row
from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.runtimeline import run_timeline, step_starts
from memdoctor.analysis.steps import categories_at_peak, peak_step, step_peak_bytes
from memdoctor.errors import UsageError
from memdoctor.trace import CATEGORIES, PHASES, StepRecord, Trace, load_trace, paused_gc

if TYPE_CHECKING:
    import pandas as pd

# The ledger's byte columns: a module's own parameters, gradients and optimizer state (what it holds
# directly), its activations inclusive of submodules, as the trace records them.
_LEDGER_RENAME = {
    "index": "module",
    "param_bytes": "parameters",
    "grad_bytes": "gradients",
    "optimizer_state_bytes": "optimizer_state",
    "activation_bytes": "activations",
    "activation_self_bytes": "activations_self",
    "checkpoint_free_bytes": "checkpoint_frees",
}
_INT_COLUMNS = (
    *("parameters", "gradients", "optimizer_state", "activations", "activations_self", "checkpoint_frees"),
    *("parameters_inclusive", "gradients_inclusive", "optimizer_state_inclusive", "calls", "other"),
    *("allocated", "reserved", "max_allocated", "peak_bytes", "depth", "model", "module"),
)


def load(path: str | os.PathLike[str], *, salvage: bool = False) -> TraceFrames:
    """Read the trace at ``path`` (a ``trace.jsonl.gz``, or the folder holding one) for DataFrames.
    ``salvage=True`` reads a trace cut short up to its last whole record, as ``memdoctor report
    --salvage`` does."""
    from memdoctor.trace import TRACE_FILENAME

    p = os.fspath(path)
    if os.path.isdir(p) and os.path.isfile(os.path.join(p, TRACE_FILENAME)):
        p = os.path.join(p, TRACE_FILENAME)
    with paused_gc():
        return TraceFrames(load_trace(p, salvage=salvage))


class TraceFrames:
    """One loaded trace and its frames (see the module docstring): ``ledger``, ``steps``,
    ``timeline``, ``findings``, ``events``, and ``summary`` (``summary.json``'s dict)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def __repr__(self) -> str:
        peak = self.trace_peak_bytes
        return (
            f"<memdoctor trace {self.trace.path}: {len(self.trace.steps)} steps, {len(self.trace.models)} "
            f"model(s), peak {peak if peak is not None else 'unknown'} bytes on "
            f"{self.trace.device.get('name', 'unknown')}>"
        )

    @property
    def trace_peak_bytes(self) -> int | None:
        """The peak of the step the report leads with (``summary.json``'s ``peak_memory_bytes``)."""
        step = peak_step(self.trace)
        return step_peak_bytes(step) if step is not None else None

    @cached_property
    def summary(self) -> dict[str, Any]:
        """``summary.json``'s content: the analysis, the plan and its findings (built once)."""
        from memdoctor.report import build_summary  # the plan and matplotlib: only when asked for

        with paused_gc():
            return build_summary(self.trace)

    @cached_property
    def ledger(self) -> pd.DataFrame:
        """Every module of every model at the peak step (the step the report's tables show)."""
        return self.ledger_at(None)

    def ledger_at(self, step: int | None) -> pd.DataFrame:
        """Every module of every model at step number ``step`` (None: the peak step), one row each:
        ``parameters``, ``gradients``, ``optimizer_state`` the module's own; ``activations`` saved for
        backward inside it (submodules included); ``*_inclusive`` summed over its subtree."""
        record = peak_step(self.trace) if step is None else self._step(step)
        rows = [_ledger_row(r) for r in layer_table(self.trace, record)]
        frame = _frame(rows)
        frame.insert(0, "step", record.step if record is not None else None)
        return frame

    def _step(self, number: int) -> StepRecord:
        found = next((s for s in self.trace.steps if s.step == number), None)
        if found is None:
            have = ", ".join(str(s.step) for s in self.trace.steps) or "none"
            raise UsageError(f"{self.trace.path}: no step {number} in this trace (steps: {have})")
        if found.detail != "full":
            full = ", ".join(str(s.step) for s in self.trace.steps if s.detail == "full") or "none"
            raise UsageError(
                f"{self.trace.path}: step {number} is a timing step, without the per-module ledger "
                f"(steps with it: {full})"
            )
        return found

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per step record: when it ran, its phases, its peak and the categories at the peak."""
        rows = [
            _step_row(s, start) for s, start in zip(self.trace.steps, step_starts(self.trace), strict=True)
        ]
        return _frame(rows)

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """Every timeline sample of every step: ``time_ms`` on the run's clock, ``t_ms`` within its step,
        the event and module, and the memory figures (None where a step did not measure one)."""
        return _frame(run_timeline(self.trace))

    @cached_property
    def findings(self) -> pd.DataFrame:
        """The plan's findings, one row each (rule, severity, title, evidence, saving_bytes, ...)."""
        frame = _frame(list(self.summary.get("findings") or []))
        return frame if len(frame.columns) else _frame([], columns=["rule", "severity", "title", "evidence"])

    @cached_property
    def events(self) -> pd.DataFrame:
        """The trace's events (errors, out-of-memory, stops), one row each."""
        rows = [event_row(self.trace, e) for e in self.trace.events]
        return _frame(
            rows, columns=["kind", "message", "exception_type", "step", "phase", "module_name", "t_unix"]
        )


def _ledger_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {_LEDGER_RENAME.get(k, k): v for k, v in row.items() if k != "inclusive"}
    inclusive = row.get("inclusive") or {}
    for category in ("parameters", "gradients", "optimizer_state"):
        out[f"{category}_inclusive"] = inclusive.get(category)
    return out


def _step_row(step: StepRecord, start: float) -> dict[str, Any]:
    phases = {f"{p}_ms": step.phases_ms.get(p) for p in PHASES}
    cats = categories_at_peak(step) if step.detail == "full" else dict.fromkeys(CATEGORIES)
    return {
        "step": step.step,
        "warmup": step.warmup,
        "complete": step.complete,
        "detail": step.detail,
        "start_ms": start,
        "duration_ms": step.duration_ms,
        **phases,
        "micro_batches": step.micro_batches,
        "peak_bytes": step_peak_bytes(step),
        "peak_phase": step.memory.get("peak_phase"),
        **cats,
    }


def _frame(data: Any, columns: list[str] | None = None) -> pd.DataFrame:
    """A DataFrame whose byte and count columns are nullable integers (``Int64``): "not measured"
    stays ``<NA>``, apart from 0, instead of turning the column into floats."""
    try:
        import pandas as pd
    except ImportError:
        raise UsageError("memdoctor.load needs pandas: pip install pandas") from None
    frame = pd.DataFrame(data, columns=columns)
    for name in _INT_COLUMNS:
        if name in frame.columns:
            frame[name] = frame[name].astype("Int64")
    return frame
