"""One ``--verify`` round (``memdoctor.launch.verify``): profile with a plan applied, and what it
measured against what the plan predicted, in a record and in one terminal line.

Why apart from the loop: the loop decides what to verify next; this only runs and reads one round.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from memdoctor import exitcodes
from memdoctor.analysis.verified import refused_family, round_reason
from memdoctor.config import CONFIG_FILENAME, PlanConfig, dump_config
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult, Runner
from memdoctor.outputs import round_folder
from memdoctor.plan.target import Target
from memdoctor.trace import Trace, read_trace
from memdoctor.units import format_bytes

# A round profiles at least this many steps after its warm-up: the first and last are ledger steps,
# the ones between timing steps, whose median is the step time plans are compared by. With the
# profile's usual 3 (one timing step, the process's third) the story on the H200 measured 97 ms for
# the plan that then trained at 58 ms and 92 ms for one that trained at 74 ms: the wrong one won.
VERIFY_STEPS = 6


def run_round(
    k: int,
    config: PlanConfig,
    plan: dict[str, Any],
    correction: float,
    request: ProfileRequest,
    run: Runner,
    target: Target,
) -> dict[str, Any]:
    """Profile with ``config`` applied into round ``k``'s folder; its record: predicted vs measured."""
    out = round_folder(request.out_dir, "verify", k)
    steps = max(request.steps, VERIFY_STEPS)
    result = run(dataclasses.replace(request, out_dir=out, config=config.as_dict(), steps=steps))
    from memdoctor.outputs import atomic_write

    atomic_write(out / CONFIG_FILENAME, dump_config(config))  # what this round applied, for the user
    measured = measure(read_trace(result.trace_path), result.summary)
    outcome = _outcome(result, measured, target.budget_bytes)
    refused = refused_family(result.message, config.as_dict()) if outcome == "refused" else None
    return {
        "round": k,
        "trace": f"{out.name}/{result.trace_path.name if result.trace_path else 'trace.jsonl.gz'}",
        "config": config.as_dict(),
        "levers": list(plan.get("levers") or []),
        "correction": round(correction, 4),
        "predicted_peak_bytes": plan.get("predicted_reserved_bytes"),
        "predicted_allocated_peak_bytes": plan.get("predicted_peak_bytes"),
        "predicted_step_time_ratio": plan.get("predicted_step_time_ratio"),
        "status": result.status,
        "message": result.message,
        **measured,
        "outcome": outcome,
        "fits": outcome == "fits",
        "refused_lever": refused,
    }


def measure(trace: Trace | None, summary: dict[str, Any] | None) -> dict[str, Any]:
    """The verified run's peaks (largest over all its steps, the warm-up included: the card must hold
    it) and step time. ``peak_basis`` says what the peak is: ``reserved`` (the CUDA caching allocator's
    reserved bytes, what a budget must hold), ``accounting`` (memdoctor's tensor accounting: a CPU run
    has no allocator figures), or None when the run measured no peak."""
    steps = trace.steps if trace is not None else []
    allocator = [s.memory.get("allocator") or {} for s in steps]
    reserved = _max(a.get("max_reserved") for a in allocator)
    allocated = _max(a.get("max_allocated") for a in allocator)
    basis: str | None = "reserved"
    if reserved is None:
        reserved = allocated = _max(s.memory.get("peak_bytes") for s in steps)
        basis = "accounting" if reserved is not None else None
    ms, step_basis = step_ms(trace, summary)
    return {
        "peak_basis": basis,
        "measured_peak_bytes": reserved,
        "measured_allocated_peak_bytes": allocated,
        "measured_step_time_ms": ms,
        "step_time_basis": step_basis,
        "config_applied": trace is not None and trace.header.get("applied_config") is not None,
    }


def step_ms(trace: Trace | None, summary: dict[str, Any] | None) -> tuple[float | None, str | None]:
    """The verified run's step time and what it is the median of: its timing steps (no module hooks:
    the script's own time) where it had any, else its profiled steps (``summary.json``'s
    ``step_time_ms``). Plans are compared by it, and the ledger steps' hooks cost a checkpointed plan
    more than others (each recomputed module runs them again): on GPT-2 in the Trainer 145 ms against
    136 ms on the timing step alone."""
    steps = [s for s in (trace.steps if trace is not None else []) if s.complete and not s.warmup]
    timing = [float(s.duration_ms) for s in steps if s.detail == "timing" and s.duration_ms]
    if timing:
        return round(statistics.median(timing), 3), "timing steps"
    step_ms = (summary or {}).get("step_time_ms")
    return (float(step_ms), "profiled steps") if isinstance(step_ms, (int, float)) else (None, None)


def step_ratio(measured_ms: float | None, baseline_ms: float | None) -> float | None:
    """The verified run's step time over the first run's (None when either was not measured)."""
    if not measured_ms or not baseline_ms:
        return None
    return round(float(measured_ms) / float(baseline_ms), 4)


def _max(values: Any) -> int | None:
    found = [int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(found) if found else None


REFUSED_STATUS = "config_error"  # the supervisor's status for a plan a part of which could not apply


def _outcome(result: ProfileResult, measured: dict[str, Any], budget: int) -> str:
    """``fits``, ``over_budget`` (measured peak > budget), ``oom``, ``refused`` (a part of the plan
    could not be applied to the script) or ``failed`` (any other failure)."""
    if result.exit_code == exitcodes.OUT_OF_MEMORY:
        return "oom"
    if result.status == REFUSED_STATUS:
        return "refused"
    if result.exit_code != exitcodes.OK:
        return "failed"
    peak = measured["measured_peak_bytes"]
    return "over_budget" if peak is not None and peak > budget else "fits"


def round_line(r: dict[str, Any]) -> str:
    """One line: measured vs predicted peak and step time, and the verdict (why, when it failed)."""
    if r["outcome"] in ("refused", "failed"):
        return round_reason(r)
    basis = {"reserved": " reserved", "accounting": " (tensor accounting)"}.get(r["peak_basis"] or "", "")
    if r["measured_peak_bytes"] is None:
        peak = f"peak not measured, {format_bytes(r['predicted_peak_bytes'])} predicted"
    else:
        peak = (
            f"measured peak {format_bytes(r['measured_peak_bytes'])}{basis} vs "
            f"{format_bytes(r['predicted_peak_bytes'])} predicted"
        )
    ratio = r.get("measured_step_time_ratio")
    predicted = r.get("predicted_step_time_ratio")
    time = "step time " + ("n/a" if ratio is None else f"x{ratio:.2f}") + " measured vs "
    time += "unknown" if predicted is None else f"x{predicted:.2f}"
    verdict = {"fits": "fits the budget", "over_budget": "over the budget", "oom": "ran out of memory"}[
        r["outcome"]
    ]
    applied = "" if r["config_applied"] else " [the trace does not record the config as applied]"
    return f"{peak}, {time}: {verdict}{applied}"
