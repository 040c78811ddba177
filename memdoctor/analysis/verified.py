"""The "Measured vs predicted" section: what ``memdoctor profile --verify`` measured against the plan.

``--verify`` (``memdoctor.launch.verify``) writes a run-wide ``collector`` record named ``verify`` into
the first run's trace: one entry per verified round (the config applied, its predicted and measured
peak and step time). ``summarize`` turns the last round into ``summary.json``'s ``verified`` (null when
the run was not verified); ``verify_record`` and ``rounds_with_error`` are what the report's section
shows. Pure data: no torch.
"""

from __future__ import annotations

from typing import Any

from memdoctor.trace import Trace

RECORD_NAME = "verify"  # memdoctor.launch.verify.RECORD_NAME (not imported: that module runs profiles)
APPLIED_NOTE = (
    "this run was profiled with a memdoctor.yaml applied (the header's applied_config): it is itself the "
    "run that verifies a plan, and the comparison is in the report of the run that made the plan"
)
_ROUND_KEYS = (
    "round",
    "trace",
    "levers",
    "correction",
    "outcome",
    "fits",
    "status",
    "config_applied",
    "peak_basis",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "predicted_allocated_peak_bytes",
    "measured_allocated_peak_bytes",
    "predicted_step_time_ratio",
    "measured_step_time_ratio",
    "measured_step_time_ms",
    "step_time_basis",
    "avoided",
    "margin",
)

_NUMBERS = tuple(
    k
    for k in _ROUND_KEYS
    if k.endswith(("_bytes", "_ratio", "_ms")) or k in ("round", "correction", "margin")
)
# A compared round (``avoided`` set: the best plan without the first plan's micro-batching or
# checkpointing, ``memdoctor.launch.verify``) becomes the plan when its measured step time is at least
# this much shorter; less is within the run-to-run noise of short runs (BENCHMARKS.md).
COMPARED_MIN_GAIN = 0.03


def rounds(trace: Trace) -> list[dict[str, Any]]:
    """The verified rounds recorded in ``trace`` (each with every ``_ROUND_KEYS`` key), in order."""
    record = trace.collected.get(RECORD_NAME) or {}
    found = record.get("rounds")
    rows = [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []
    return [_clean(r) for r in rows]


def _clean(r: dict[str, Any]) -> dict[str, Any]:
    """One round with every key, numbers only where numbers belong (a trace is input: never trust it)."""
    out = {key: r.get(key) for key in _ROUND_KEYS}
    for key in _NUMBERS:
        out[key] = _number(out[key])
    levers = out["levers"]
    out["levers"] = [str(v) for v in levers] if isinstance(levers, list) else []
    for key in ("fits", "config_applied"):
        out[key] = out[key] is True
    for key in ("trace", "outcome", "status", "peak_basis", "avoided", "step_time_basis"):
        out[key] = None if out[key] is None else str(out[key])
    return out


def peak_error(measured: Any, predicted: Any) -> float | None:
    """(measured - predicted) / predicted: positive means the plan under-predicted (an OOM risk)."""
    if not isinstance(measured, (int, float)) or not isinstance(predicted, (int, float)) or predicted <= 0:
        return None
    return round((measured - predicted) / predicted, 4)


def chosen_round(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round whose config is the plan: the first that fits, unless a compared round fits and
    measured a step time ``COMPARED_MIN_GAIN`` shorter; None when no round fits."""
    fitting = [r for r in rows if r.get("fits") is True]
    if not fitting:
        return None
    first = next((r for r in fitting if not r.get("avoided")), fitting[0])
    faster = [r for r in fitting if r.get("avoided") and _faster(r, first)]
    return min(faster, key=lambda r: r["measured_step_time_ms"]) if faster else first


def _faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = a.get("measured_step_time_ms"), b.get("measured_step_time_ms")
    numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in (ta, tb))
    return numbers and float(ta) < float(tb) * (1.0 - COMPARED_MIN_GAIN)  # type: ignore[arg-type]


def verified(trace: Trace) -> dict[str, Any] | None:
    """``summary.json``'s ``verified``: the figures of the round whose config is the plan (the last
    round when none fits), the round count and every round."""
    rows = rounds(trace)
    if not rows:
        return None
    last = chosen_round(rows) or rows[-1]
    keys = [k for k in _ROUND_KEYS if k not in ("round", "levers", "correction", "status")]
    out = {k: last[k] for k in keys}
    out["peak_error"] = peak_error(last["measured_peak_bytes"], last["predicted_peak_bytes"])
    out["round"] = last["round"]
    out["rounds"] = len(rows)
    out["history"] = rows
    return out


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``verified``: null unless the run was profiled with ``--verify`` and at least one round ran."""
    summary["verified"] = verified(trace)


def verify_record(trace: Trace) -> dict[str, Any] | None:
    """The verify record's run-wide fields (why it was skipped or stopped, the budget, the round limit,
    the OOM floor); a run profiled with a plan applied is itself a verify round, and says so. None when
    the run was not verified."""
    record = trace.collected.get(RECORD_NAME)
    if not isinstance(record, dict) and trace.header.get("applied_config") is not None:
        record = {"skipped": APPLIED_NOTE}
    if not isinstance(record, dict):
        return None
    return {
        "skipped": record.get("skipped"),
        "stopped": record.get("stopped"),
        "budget_bytes": _number(record.get("budget_bytes")),
        "max_rounds": _number(record.get("max_rounds")),
        "oom_floor": _number(record.get("oom_floor")),
    }


def rounds_with_error(trace: Trace) -> list[dict[str, Any]]:
    """``rounds`` with each round's ``peak_error``, for the report's table."""
    rows = rounds(trace)
    for r in rows:
        r["peak_error"] = peak_error(r["measured_peak_bytes"], r["predicted_peak_bytes"])
    return rows


def _number(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
