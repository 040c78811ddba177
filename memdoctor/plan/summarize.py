"""The plan section: the nine-grid, the rules' findings and the plan for the run's budget.

``summarize`` adds ``ninegrid``, ``findings`` and ``plan`` to ``summary.json`` (it runs after the other
sections, whose keys it reads). The budget is the run's ``--budget`` (or memory cap) when it had one,
else the profiled GPU's memory less the CUDA context reserve; a CPU run without a budget has no plan
(``plan`` null; ``memdoctor plan TRACE --budget SIZE`` makes one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from memdoctor.analysis.verified import chosen_round, learned, plan_note, rounds
from memdoctor.cards import CONTEXT_RESERVE_BYTES, Card, find_card
from memdoctor.errors import UsageError
from memdoctor.plan.agreement import plan_notes
from memdoctor.plan.alternatives import alternatives
from memdoctor.plan.model import workload
from memdoctor.plan.ninegrid import ninegrid, priority
from memdoctor.plan.parallel import distributed
from memdoctor.plan.planner import gpus_needed, make_plan, needed_row, needed_words
from memdoctor.plan.reprofiled import advice as reprofile_advice
from memdoctor.plan.reprofiled import peak_words
from memdoctor.plan.reprofiled import summary_record as reprofile_record
from memdoctor.plan.rules import RuleInput, run_rules
from memdoctor.plan.target import Target
from memdoctor.plan.workload import corrected_workload
from memdoctor.trace import Trace


def summary_target(summary: dict[str, Any]) -> Target | None:
    """The budget the run was judged against: ``--budget``/cap as given, else the GPU less its context;
    with the card ``profile --gpu`` named, whose features (bf16, fp16 tensor cores, PCIe, FLOP rate)
    the plan is made for."""
    device = summary.get("device") or {}
    budget = summary.get("budget_bytes") or device.get("memory_cap_bytes")
    card = profiled_card(summary)
    if card is not None:
        return Target(int(budget or card.usable_bytes), card)
    if budget:
        return Target(int(budget))
    total = device.get("total_memory_bytes")
    if device.get("kind") == "cuda" and total:
        return Target(int(total) - CONTEXT_RESERVE_BYTES)
    return None


def ranks_target(trace: Trace, target: Target | None) -> Target | None:
    """``target`` on as many cards as the trace's job had ranks (its header's ``distributed``): a
    rank's trace is planned for the job it ran in."""
    size = distributed(trace.header).get("world_size")
    if target is None or not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        return target
    return replace(target, gpus=size)


def profiled_card(summary: dict[str, Any]) -> Card | None:
    """The card ``profile --gpu`` named (``summary["gpu"]``); None without one, or for a name this
    memdoctor does not list (a trace from another version: then planned for its budget alone)."""
    name = summary.get("gpu")
    if not isinstance(name, str):
        return None
    try:
        return find_card(name)
    except UsageError:
        return None


def doctor(trace: Trace, summary: dict[str, Any], target: Target | None) -> dict[str, Any]:
    """``{ninegrid, findings, plan, reason}`` for ``target`` (``plan`` None with ``reason`` when none)."""
    w = workload(trace, summary)
    grid = ninegrid(summary, w, target.budget_bytes if target else None)
    ranked = priority(grid)
    order = ranked["order"]
    findings = run_rules(RuleInput(trace, summary, w, target, order))
    reason = None
    if w is None:
        reason = "no step of this trace has a memory figure to plan from"
    elif target is None:
        reason = (
            "no budget: this run had no --budget and no GPU (memdoctor plan TRACE --budget SIZE makes one)"
        )
    plan, made = None, None
    if w is not None and target is not None:
        choice = verified_choice(trace)
        pw = corrected_workload(w, choice.correction) if choice.correction > 1.0 else w
        searched = target if choice.margin is None else replace(target, margin=choice.margin)
        made = make_plan(pw, searched, order, avoid=choice.avoided, exclude=choice.excluded)
        plan = {**made.as_dict(), "model": pw.model, "alternatives": alternatives(pw, searched, made)}
        plan["gpus_needed"] = None
        if not made.fits and made.reason is None:  # "which cards, and how many": the fewest that fit
            needed = gpus_needed(pw, searched, order)
            plan["gpus_needed"] = needed_row(needed)
            at = 0 if searched.gpus > 1 else len(plan["advice"])  # first when the user asked for N
            plan["advice"].insert(at, needed_words(searched, needed, pw))
        # what the plan's precision starts from (its "fp32" keeps a script's own autocast)
        plan["script_precision"] = w.script_precision
        plan["script_autocast"] = w.script_autocast
        if choice.round is not None:
            plan["advice"].insert(0, _verified_advice(choice))
        plan["verified_fits"] = choice.verified
        plan["planned_peak"] = peak_words(trace, pw)  # the peak the plan is made from, with its kind
        plan["verify_note"] = plan_note(trace, plan)
        if choice.verified is False and plan["verify_note"]:
            plan["advice"].insert(0, plan["verify_note"])
        reprofiled = reprofile_record(trace)
        if reprofiled is not None:
            plan["advice"].insert(0, reprofile_advice(reprofiled))
    plan_notes(findings, made, w)
    return {
        "ninegrid": grid,
        "lever_priority": ranked,
        "findings": findings,
        "plan": plan,
        "reason": reason,
        "workload": w,
    }


class Search(NamedTuple):
    """How the report's plan is searched: the first plan's search (the defaults), or that of the verify
    ``round`` whose config became the plan (``verified_choice``)."""

    correction: float = 1.0  # memory predictions raised by this factor
    avoided: str | None = None  # the lever family left out
    round: int | None = None
    margin: float | None = None  # the safety margin it was searched with (None: the default)
    excluded: tuple[str, ...] = ()  # lever families memdoctor run refused for the script (--verify)
    verified: bool | None = None  # a --verify round measured this search's config fitting; None: no rounds


def verified_choice(trace: Trace) -> Search:
    """The search of the plan ``profile --verify`` measured into the plan, when it is not the first
    one: a re-plan that fitted (its memory predictions raised by ``correction``, without the lever
    families ``memdoctor run`` refused, ``excluded``), or a compared plan without ``avoided`` that
    measured faster (``chosen_round``), searched with the safety ``margin`` it records. The plan of the
    report and of memdoctor.yaml is then that round's: the same search. When no round fits, the search
    with everything the rounds learned (``verified`` False: never the first plan, which a round saw
    fail, presented as planned to fit). ``Search()`` when the run was not verified."""
    rows = rounds(trace)
    if not rows:
        return Search()
    best = chosen_round(rows)
    if best is None:
        found = learned(trace)
        return Search(found["correction"], excluded=tuple(found["excluded"]), verified=False)
    factor = float(best["correction"] or 1.0)
    avoided, excluded = best["avoided"], tuple(best["excluded"])
    if factor <= 1.0 and not avoided and not excluded:
        return Search(verified=True)
    margin = best["margin"]
    at = None if margin is None else float(margin)
    return Search(factor, avoided, int(best["round"]), at, excluded, verified=True)


def _verified_advice(choice: Search) -> str:
    parts = []
    if choice.correction > 1.0:
        parts.append(
            f"re-planned with memory predictions raised x{choice.correction:.2f}: the first plan's verified "
            "run needed more memory than predicted"
        )
    if choice.excluded:
        parts.append(f"without {', '.join(choice.excluded)}: memdoctor run refused it for this script")
    if choice.avoided:
        parts.append(
            f"the best plan without {choice.avoided} measured a shorter step than the first plan that fitted"
        )
    return f"the plan verify round {choice.round} measured (Measured vs predicted): " + "; and ".join(parts)


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``ninegrid``, ``lever_priority``, ``findings`` and ``plan`` (null when there is no budget or no
    memory figure)."""
    out = doctor(trace, summary, ranks_target(trace, summary_target(summary)))
    summary["ninegrid"] = out["ninegrid"]
    summary["lever_priority"] = out["lever_priority"]
    summary["findings"] = out["findings"]
    summary["plan"] = out["plan"]
    summary["reprofile"] = reprofile_record(trace)
