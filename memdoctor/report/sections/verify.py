"""The report's "Measured vs predicted" section: each ``profile --verify`` round's predicted and measured
peak and step time, the round whose config is the plan, each round that did not fit and why, and why
verification stopped; when no round fits, that memdoctor.yaml is not planned to fit, and what to try."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.verified import (
    COMPARED_MIN_GAIN,
    chosen_round,
    failed_rounds,
    learned,
    rounds_with_error,
    verify_record,
)
from memdoctor.report.plots_verify import peak_bars
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The rounds, the chart and why verification stopped; None when the run was not verified."""
    record = verify_record(trace)
    if record is None:
        return None
    rows = rounds_with_error(trace)
    plan = summary.get("plan") or {}
    return {
        "skipped": record["skipped"],
        "stopped": record["stopped"],
        "rounds": rows,
        "final": (chosen_round(rows) or rows[-1]) if rows else None,
        "plan_verified": chosen_round(rows) is not None,
        "failed": failed_rounds(rows),
        "excluded": learned(trace)["excluded"],
        "plan_note": plan.get("verify_note") if plan.get("verified_fits") is False else None,
        "budget_bytes": record["budget_bytes"],
        "max_rounds": record["max_rounds"],
        "oom_floor": record["oom_floor"],
        "compared_min_gain": COMPARED_MIN_GAIN,
        "chart": peak_bars(rows, record["budget_bytes"]),
    }
