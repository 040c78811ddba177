"""How a run died: the fault, what was live at its last sample, and the summary's event rows."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.layers import model_by_index, model_prefix, module_label
from memdoctor.analysis.numbers import opt_int
from memdoctor.analysis.steps import category_columns
from memdoctor.trace import StepRecord, Trace

_NORMAL_STATUSES = ("completed", "script_finished", "no_steps")
_FAULT_EVENT_KINDS = ("oom", "exception", "interrupted", "script_exit")
_ALLOCATOR_COLUMNS = ("allocated", "reserved", "max_allocated")


def fault_info(trace: Trace) -> dict[str, Any] | None:
    """How the run died, or ``None`` when it ended normally: from the end record and the last fault event."""
    end = trace.end or {}
    event = next((e for e in reversed(trace.events) if e.get("kind") in _FAULT_EVENT_KINDS), None)
    if not _is_fault(end, event, _dying_step(trace)):
        return None
    event = event or {}
    where = _last_sample_where(trace)
    return {
        "kind": end.get("status") or event.get("kind") or "unknown",
        "message": event.get("message") or end.get("message") or "",
        "exception_type": event.get("exception_type"),
        "signal": end.get("signal"),
        "exit_code": end.get("exit_code"),
        # An event with a null step: the script died before its first training step.
        "step": event["step"] if "step" in event else where.get("step"),
        "phase": _first(event.get("phase"), where.get("phase")),
        "module_name": _first(_event_module(trace, event), where.get("module_name")),
    }


_PHASE_WORDS = {"forward": "its forward", "backward": "its backward", "optimizer": "its optimizer step"}


def died_in(trace: Trace) -> str | None:
    """Where the run died, for a run cut short in a step it never finished (``its forward, in GPT``,
    ``its backward``, ``its optimizer step``); None when no step was left unfinished. Wherever that
    was, the step's peak was never measured: a child module's forward, the root's own code (a logits
    upcast), a loss computed in the loop, backward, the optimizer step."""
    if _dying_step(trace) is None:
        return None
    info = fault_info(trace) or {}
    where = _PHASE_WORDS.get(str(info.get("phase")), "a step")
    module = info.get("module_name")
    return f"{where}, in {module}" if module else where


def _is_fault(end: dict[str, Any], event: dict[str, Any] | None, dying: StepRecord | None) -> bool:
    status = end.get("status")
    if status is None:
        return (event is not None and event.get("kind") != "script_exit") or bool(dying)
    if status == "script_exit":
        return end.get("exit_code") not in (0, None)
    return status not in _NORMAL_STATUSES


def _event_module(trace: Trace, event: dict[str, Any]) -> str | None:
    label = module_label(trace, event.get("model"), event.get("module"))
    name = event.get("module_name")
    if label is None and name is not None and len(trace.models) > 1 and event.get("model") is not None:
        return f"model{event['model']}:{name}"
    return label or name


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _dying_step(trace: Trace) -> StepRecord | None:
    return next((s for s in reversed(trace.steps) if not s.complete), None)


def _last_sample_where(trace: Trace) -> dict[str, Any]:
    live = live_at_fault(trace)
    if live is None:
        return {}
    stack = live["module_stack"]
    return {"step": live["step"], "phase": live["phase"], "module_name": stack[-1] if stack else None}


def live_at_fault(trace: Trace) -> dict[str, Any] | None:
    """The last timeline sample of the step the run died in: what was live, and which modules were running."""
    step = _dying_step(trace)
    t_ms = (step.timeline.get("t_ms") or []) if step else []
    if step is None or not t_ms:
        return None
    i = len(t_ms) - 1
    tl = step.timeline
    cats = {c: opt_int(col[i]) for c, col in category_columns(step).items()}
    return {
        "step": step.step,
        "t_ms": float(t_ms[i]),
        "event": _at(tl.get("event"), i),
        "phase": _at(tl.get("phase"), i),
        "categories": cats,
        "allocator": {c: opt_int(_at(tl.get(c), i)) for c in _ALLOCATOR_COLUMNS if tl.get(c) is not None},
        "module_stack": module_stack(trace, _at(tl.get("model"), i), _at(tl.get("module"), i)),
    }


def _at(col: list[Any] | None, i: int) -> Any:
    return col[i] if col is not None and i < len(col) else None


def module_stack(trace: Trace, model: Any, module: Any) -> list[str]:
    """Display names from the root down to ``module`` (empty when unknown)."""
    info = model_by_index(trace, model if model is not None else 0)
    if info is None or not isinstance(module, int) or not 0 <= module < len(info.names):
        return []
    chain = [module]
    while info.parents[chain[-1]] >= 0 and len(chain) <= len(info.names):
        chain.append(info.parents[chain[-1]])
    return [model_prefix(trace, info) + info.display_name(i) for i in reversed(chain)]


def event_row(trace: Trace, event: dict[str, Any]) -> dict[str, Any]:
    """The fields of an event that the summary keeps (tracebacks stay in the trace)."""
    return {
        "kind": event.get("kind"),
        "message": event.get("message", ""),
        "exception_type": event.get("exception_type"),
        "step": event.get("step"),
        "phase": event.get("phase"),
        "module_name": _event_module(trace, event),
        "t_unix": event.get("t_unix"),
    }
