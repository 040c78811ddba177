"""``memdoctor profile --verify``: apply the plan, profile again, set the measurement beside the prediction.

Why: a prediction nobody checks is a guess. After the first profile, the plan's config is applied in a
second profiling run of the same script under the same budget (the same ``--budget`` cap on a larger
GPU); its measured peak and step time are compared with what the planner predicted. When the verified
run does not fit (it ran out of memory, or its peak is over the budget), the planner runs again on the
*first* trace with its memory predictions raised by the error just measured (``corrected_workload``),
and the new config is verified in turn, at most ``max_rounds`` rounds in all.

Each round profiles into its own folder inside the first one (``OUT/verify``, ``OUT/verify-2``, ...,
never over the first run's files) and leaves there the config it applied as ``memdoctor.yaml``. The
result is a run-wide ``collector`` record named ``verify`` (``RECORD_NAME``) that ``launch/rounds.py``
writes into the FIRST trace, so the report section and ``summary.json``'s ``verified`` are derived from
the trace like everything else (``memdoctor report`` re-renders them); the round traces need not be
kept.

The profile runner is a parameter, so the loop is testable without a child process.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.analysis.verified import chosen_round
from memdoctor.config import CONFIG_FILENAME, PlanConfig, dump_config, from_plan
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult, Runner, Say
from memdoctor.outputs import round_folder
from memdoctor.plan.measure import batch_size
from memdoctor.plan.model import workload
from memdoctor.plan.planner import compared_plan, make_plan, runner_up
from memdoctor.plan.summarize import summary_target
from memdoctor.plan.target import Target
from memdoctor.plan.workload import Workload, corrected_workload
from memdoctor.trace import Trace, read_trace
from memdoctor.units import format_bytes

RECORD_NAME = "verify"
DEFAULT_ROUNDS = 3
# A run that died of OOM needed more than its budget; how much more is not measured. The re-plan
# assumes at least this much more (an assumption, stated in the record's notes).
OOM_FLOOR = 1.05
VERIFIABLE_EXIT_CODES = (exitcodes.OK, exitcodes.OUT_OF_MEMORY)


def verify(
    trace: Trace,
    summary: dict[str, Any],
    request: ProfileRequest,
    run: Runner,
    say: Say,
    *,
    max_rounds: int = DEFAULT_ROUNDS,
) -> dict[str, Any]:
    """Verify the first run's plan in up to ``max_rounds`` rounds; return the ``verify`` record."""
    target = summary_target(summary)
    plan = summary.get("plan")
    record = _record(summary, target, max_rounds)
    w = workload(trace, summary)
    skipped = nothing_to_verify(plan)
    if trace.header.get("applied_config") is not None:  # profile --config: its plan is not for the script
        skipped = "the profiled run had a config applied (--config); verify plans from the script as it is"
    if skipped is None and (w is None or target is None):
        skipped = "the first run has no memory figure or no budget to plan from"
    if skipped is not None:
        say(f"verify: not verified: {skipped}")
        record["skipped"] = skipped
        return record
    assert plan is not None and w is not None and target is not None
    rounds = _Rounds(trace, summary, request, run, say, target, max_rounds)
    record["rounds"], record["stopped"] = rounds.loop(w, plan)
    if record["stopped"]:
        say(f"verify: stopped: {record['stopped']}")
    best = chosen_round(record["rounds"])
    if best is not None and best["round"] > 1:
        where = request.out_dir / CONFIG_FILENAME
        say(f"verify: the plan is now round {best['round']}'s config ({best['trace']}): apply {where}")
    return record


@dataclasses.dataclass
class _Rounds:
    """The verify loop's fixed inputs: the first run, how to profile, where to report."""

    trace: Trace
    summary: dict[str, Any]
    request: ProfileRequest
    run: Runner
    say: Say
    target: Target
    max_rounds: int

    def loop(self, w: Workload, plan: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
        """Verify ``plan``; re-plan and verify again while it does not fit. (rounds, why it stopped)."""
        done: list[dict[str, Any]] = []
        correction = 1.0
        order = (self.summary.get("lever_priority") or {}).get("order")  # as the report's plan does
        for k in range(1, self.max_rounds + 1):
            r = self.one(k, plan, correction)
            done.append(r)
            stopped = _why_stop(r, k, self.max_rounds)
            if r["fits"] and k < self.max_rounds:
                self.compare(k + 1, w, correction, order, done)
            if stopped is not None or r["fits"]:
                return done, stopped
            correction *= error_factor(r, self.target.budget_bytes)
            plan = make_plan(corrected_workload(w, correction), self.target, order).as_dict()
            if not plan["fits"]:
                return done, (
                    f"with memory predictions raised x{correction:.2f} (what round {k} measured), nothing "
                    "the planner models fits the budget"
                )
            self.say(f"verify: re-planned with memory predictions raised x{correction:.2f}: {_levers(plan)}")
        return done, None  # not reached: the last round always stops

    def compare(self, k: int, w: Workload, correction: float, order: Any, done: list[dict[str, Any]]) -> None:
        """From round ``k``: the plan of round ``k - 1`` fits; measure the best plan without its
        costliest-to-predict lever too (``runner_up``), so that the faster of the two, measured, becomes
        the plan. A compared plan that does not fit is re-planned with its measured error, as the plan
        is, while rounds remain."""
        first = make_plan(_corrected(w, correction), self.target, order)
        other = runner_up(_corrected(w, correction), self.target, first, order)
        if other is None:
            return
        family = other.avoided
        assert family is not None
        self.say(
            f"verify: the plan fits; measuring the best plan without {family} too, to compare step times"
        )
        while other is not None:
            r = self.one(k, other.as_dict(), correction, avoided=family)
            r["margin"] = other.target.margin
            done.append(r)
            if r["fits"]:
                faster = chosen_round(done) is r
                verdict = (
                    "measured faster: it is the plan now" if faster else "measured no faster: the plan stands"
                )
                self.say(f"verify: the plan without {family} {verdict}")
                return
            if k == self.max_rounds or r["outcome"] not in ("oom", "over_budget"):
                self.say(f"verify: the plan without {family} does not fit: the plan stands")
                return
            correction *= error_factor(r, self.target.budget_bytes)
            other = compared_plan(corrected_workload(w, correction), self.target, family, order)
            k += 1
            if other is not None:
                self.say(
                    f"verify: re-planned the plan without {family} with memory predictions raised "
                    f"x{correction:.2f}: {_levers(other.as_dict())}"
                )

    def one(
        self, k: int, plan: dict[str, Any], correction: float, avoided: str | None = None
    ) -> dict[str, Any]:
        """Round ``k``: profile with ``plan`` applied, and say how it went."""
        n = self.max_rounds
        self.say(f"verify round {k}/{n}: profiling with the plan applied ({_levers(plan)}) ...")
        config = _config(plan, self.trace, self.summary)
        r = run_round(k, config, plan, correction, self.request, self.run, self.target)
        r["avoided"] = avoided
        baseline, _ = _step_ms(self.trace, self.summary)  # the first run's, on the same basis
        r["measured_step_time_ratio"] = step_ratio(r["measured_step_time_ms"], baseline)
        self.say(f"verify round {k}/{n}: {round_line(r)}")
        return r


def _corrected(w: Workload, correction: float) -> Workload:
    return corrected_workload(w, correction) if correction > 1.0 else w


def nothing_to_verify(plan: dict[str, Any] | None) -> str | None:
    """Why the first run's plan gives nothing to verify; None when there is a config to apply."""
    if not plan:
        return "no plan was made (the run had no --budget and no GPU, or no memory figure)"
    if plan.get("fits_as_is"):
        return "the profiled run fits its budget as it is: there is no plan to apply"
    if not plan.get("fits"):
        return "nothing the planner models fits the budget: there is no plan to apply"
    return None


def _record(summary: dict[str, Any], target: Target | None, max_rounds: int) -> dict[str, Any]:
    return {
        "budget_bytes": target.budget_bytes if target else None,
        "max_rounds": max_rounds,
        "baseline_step_time_ms": summary.get("step_time_ms"),
        "oom_floor": OOM_FLOOR,
        "skipped": None,
        "stopped": None,
        "rounds": [],
    }


def _config(plan: dict[str, Any], trace: Trace, summary: dict[str, Any]) -> PlanConfig:
    name = Path(trace.path).name if trace.path else None
    own = (summary.get("script_precision") or {}).get("autocast")  # a re-plan's dict lacks it
    plan = {**plan, "script_autocast": plan.get("script_autocast", own)}
    return from_plan(plan, trace=trace, trace_path=name, batch_size=batch_size(summary))


def _levers(plan: dict[str, Any]) -> str:
    return "; ".join(plan.get("levers") or []) or "no change"


def _why_stop(r: dict[str, Any], k: int, max_rounds: int) -> str | None:
    """Why no further round is run after round ``k`` (None: go on when it did not fit)."""
    if r["fits"]:
        return None
    if r["outcome"] == "failed":
        return f"the verified run failed ({r['status']}: {r['message']}); re-planning cannot fix that"
    if not r["config_applied"]:
        return "the verified run's trace does not record the config as applied; re-planning cannot help"
    if r["measured_peak_bytes"] is None and r["outcome"] != "oom":
        return "the verified run measured no peak to learn from"
    if k == max_rounds:
        return f"still does not fit after {max_rounds} round{'s' if max_rounds > 1 else ''} (--verify-rounds)"
    return None


# ----------------------------------------------------------------------------------------- one round


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
    result = run(dataclasses.replace(request, out_dir=out, config=config.as_dict()))
    from memdoctor.report.render import atomic_write  # the report layer's writer; imported late (matplotlib)

    atomic_write(out / CONFIG_FILENAME, dump_config(config))  # what this round applied, for the user
    measured = measure(read_trace(result.trace_path), result.summary)
    outcome = _outcome(result, measured, target.budget_bytes)
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
    step_ms, step_basis = _step_ms(trace, summary)
    return {
        "peak_basis": basis,
        "measured_peak_bytes": reserved,
        "measured_allocated_peak_bytes": allocated,
        "measured_step_time_ms": step_ms,
        "step_time_basis": step_basis,
        "config_applied": trace is not None and trace.header.get("applied_config") is not None,
    }


def _step_ms(trace: Trace | None, summary: dict[str, Any] | None) -> tuple[float | None, str | None]:
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


def _outcome(result: ProfileResult, measured: dict[str, Any], budget: int) -> str:
    """``fits``, ``over_budget`` (measured peak > budget), ``oom`` or ``failed`` (any other failure)."""
    if result.exit_code == exitcodes.OUT_OF_MEMORY:
        return "oom"
    if result.exit_code != exitcodes.OK:
        return "failed"
    peak = measured["measured_peak_bytes"]
    return "over_budget" if peak is not None and peak > budget else "fits"


# ----------------------------------------------------------------------------------------- re-planning


def error_factor(r: dict[str, Any], budget: int) -> float:
    """How much more memory round ``r`` needed than predicted (>= 1): measured / predicted peak; a run
    that died of OOM needed more than the budget, at least ``OOM_FLOOR`` x the larger of the two."""
    measured = float(r["measured_peak_bytes"] or 0)
    if r["outcome"] == "oom":
        measured = max(measured, float(budget)) * OOM_FLOOR
    predicted = float(r["predicted_peak_bytes"] or 0)
    return max(1.0, measured / predicted) if predicted > 0 else OOM_FLOOR


# ----------------------------------------------------------------------------------------- terminal


def round_line(r: dict[str, Any]) -> str:
    """One line: measured vs predicted peak and step time, and the verdict."""
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
    verdict = {
        "fits": "fits the budget",
        "over_budget": "over the budget",
        "oom": "ran out of memory",
        "failed": f"the run failed ({r['status']})",
    }[r["outcome"]]
    applied = "" if r["config_applied"] else " [the trace does not record the config as applied]"
    return f"{peak}, {time}: {verdict}{applied}"
