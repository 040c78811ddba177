"""``memdoctor profile --verify``: apply the plan, profile again, set the measurement beside the prediction.

Why: a prediction nobody checks is a guess. After the first profile, the plan's config is applied in a
second profiling run of the same script under the same budget (the same ``--budget`` cap on a larger
GPU); its measured peak and step time are compared with what the planner predicted. When the verified
run does not fit (it ran out of memory, or its peak is over the budget), the planner runs again on the
*first* trace with its memory predictions raised by the error just measured (``corrected_workload``),
and the new config is verified in turn, at most ``max_rounds`` rounds in all. A round that
``memdoctor run`` refused (a lever it cannot apply to this script, e.g. micro-batching a model whose
forward returns no loss) teaches a fact about the script, not an error: that lever's family is left
out of every later search (``make_plan``'s ``exclude``), and the plan is re-made without it.

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
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.analysis.verified import chosen_round
from memdoctor.config import CONFIG_FILENAME, PlanConfig, from_plan
from memdoctor.launch.supervisor import ProfileRequest, Runner, Say
from memdoctor.launch.verify_round import round_line, run_round, step_ms, step_ratio
from memdoctor.plan.measure import batch_size
from memdoctor.plan.model import workload
from memdoctor.plan.planner import compared_plan, make_plan, runner_up
from memdoctor.plan.summarize import summary_target
from memdoctor.plan.target import Target
from memdoctor.plan.workload import Workload, corrected_workload
from memdoctor.trace import Trace

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
    record["learned"] = rounds.learned.as_dict()
    best = chosen_round(record["rounds"])
    if best is not None and best["round"] > 1:
        where = request.out_dir / CONFIG_FILENAME
        say(f"verify: the plan is now round {best['round']}'s config ({best['trace']}): apply {where}")
    return record


@dataclasses.dataclass
class Learned:
    """What the rounds so far taught the planner about this script: its memory predictions are raised
    by ``correction`` (what the plan's own rounds measured), and ``excluded`` are the lever families
    ``memdoctor run`` refused for it (never proposed again)."""

    correction: float = 1.0
    excluded: list[str] = dataclasses.field(default_factory=list)

    def exclude(self, r: dict[str, Any]) -> bool:
        """Leave out the family round ``r`` was refused for; False when there is none to leave out
        (not a refusal, the part refused is no planner lever, or it was left out already)."""
        family = r.get("refused_lever")
        if not family or family in self.excluded:
            return False
        self.excluded.append(family)
        return True

    def as_dict(self) -> dict[str, Any]:
        return {"correction": round(self.correction, 4), "excluded": list(self.excluded)}

    def search(self, w: Workload) -> Workload:
        return _corrected(w, self.correction)


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

    def __post_init__(self) -> None:
        self.learned = Learned()
        self.order = (self.summary.get("lever_priority") or {}).get("order")  # as the report's plan does

    def loop(self, w: Workload, plan: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
        """Verify ``plan``; re-plan and verify again while it does not fit. (rounds, why it stopped)."""
        done: list[dict[str, Any]] = []
        learned = self.learned
        for k in range(1, self.max_rounds + 1):
            r = self.one(k, plan, learned.correction)
            done.append(r)
            stopped = _why_stop(r, k, self.max_rounds, learned.excluded)
            refused = learned.exclude(r)
            if r["outcome"] in ("oom", "over_budget"):
                learned.correction *= error_factor(r, self.target.budget_bytes)
            if r["fits"] and k < self.max_rounds:
                self.compare(k + 1, w, done)
            if stopped is not None or r["fits"]:
                return done, stopped
            plan = make_plan(learned.search(w), self.target, self.order, exclude=learned.excluded).as_dict()
            if not plan["fits"]:
                return done, (
                    f"re-planned {_searched(learned)} (what round {k} taught), nothing the planner models "
                    "fits the budget"
                )
            self.say(f"verify: re-planned {_searched(learned, refused)}: {_levers(plan)}")
        return done, None  # not reached: the last round always stops

    def compare(self, k: int, w: Workload, done: list[dict[str, Any]]) -> None:
        """From round ``k``: the plan of round ``k - 1`` fits; measure the best plan without its
        costliest-to-predict lever too (``runner_up``), so that the faster of the two, measured, becomes
        the plan. A compared plan that does not fit is re-planned with its measured error (or without
        a lever ``memdoctor run`` refused), as the plan is, while rounds remain."""
        correction, excluded = self.learned.correction, self.learned.excluded
        first = make_plan(_corrected(w, correction), self.target, self.order, exclude=excluded)
        other = runner_up(_corrected(w, correction), self.target, first, self.order, excluded)
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
            refused = self.learned.exclude(r)
            if k == self.max_rounds or not (refused or r["outcome"] in ("oom", "over_budget")):
                self.say(f"verify: the plan without {family} does not fit: the plan stands")
                return
            if not refused:
                correction *= error_factor(r, self.target.budget_bytes)
            other = compared_plan(_corrected(w, correction), self.target, family, self.order, excluded)
            k += 1
            if other is not None:
                self.say(
                    f"verify: re-planned the plan without {family} "
                    f"{_searched(Learned(correction, excluded), refused)}: {_levers(other.as_dict())}"
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
        r["excluded"] = list(self.learned.excluded)  # the families its plan's search left out
        baseline, _ = step_ms(self.trace, self.summary)  # the first run's, on the same basis
        r["measured_step_time_ratio"] = step_ratio(r["measured_step_time_ms"], baseline)
        self.say(f"verify round {k}/{n}: {round_line(r)}")
        return r


def _corrected(w: Workload, correction: float) -> Workload:
    return corrected_workload(w, correction) if correction > 1.0 else w


def _searched(learned: Learned, refused: bool = False) -> str:
    """How a re-plan was searched, in words: the raised predictions and the families left out."""
    parts = []
    if learned.correction > 1.0:
        parts.append(f"with memory predictions raised x{learned.correction:.2f}")
    if learned.excluded:
        why = " (memdoctor run refused it for this script)" if refused else ""
        parts.append(f"without {', '.join(learned.excluded)}{why}")
    return " and ".join(parts) or "as the first plan"


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


def _why_stop(r: dict[str, Any], k: int, max_rounds: int, excluded: list[str]) -> str | None:
    """Why no further round is run after round ``k`` (None: go on when it did not fit). ``excluded``:
    the families left out before this round (a refusal of one of them again cannot be re-planned)."""
    if r["fits"]:
        return None
    if r["outcome"] == "refused" and (r["refused_lever"] is None or r["refused_lever"] in excluded):
        return (
            f"memdoctor run could not apply the plan ({r['message']}), and the part it refused is no "
            "lever the planner can leave out"
        )
    if r["outcome"] == "failed":
        return f"the verified run failed ({r['status']}: {r['message']}); re-planning cannot fix that"
    if not r["config_applied"]:
        return "the verified run's trace does not record the config as applied; re-planning cannot help"
    if r["outcome"] == "refused":
        return _last_round(k, max_rounds)
    if r["measured_peak_bytes"] is None and r["outcome"] != "oom":
        return "the verified run measured no peak to learn from"
    return _last_round(k, max_rounds)


def _last_round(k: int, max_rounds: int) -> str | None:
    if k == max_rounds:
        return f"still does not fit after {max_rounds} round{'s' if max_rounds > 1 else ''} (--verify-rounds)"
    return None


# ----------------------------------------------------------------------------------------- re-planning


def error_factor(r: dict[str, Any], budget: int) -> float:
    """How much more memory round ``r`` needed than predicted (>= 1): measured / predicted peak; a run
    that died of OOM needed more than the budget, at least ``OOM_FLOOR`` x the larger of the two."""
    measured = float(r["measured_peak_bytes"] or 0)
    if r["outcome"] == "oom":
        measured = max(measured, float(budget)) * OOM_FLOOR
    predicted = float(r["predicted_peak_bytes"] or 0)
    return max(1.0, measured / predicted) if predicted > 0 else OOM_FLOOR
