"""The plan section: the nine-grid, the rules' findings and the plan for the run's budget.

``summarize`` adds ``ninegrid``, ``findings`` and ``plan`` to ``summary.json`` (it runs after the other
sections, whose keys it reads). The budget is the run's ``--budget`` (or memory cap) when it had one,
else the profiled GPU's memory less the CUDA context reserve; a CPU run without a budget has no plan
(``plan`` null; ``memdoctor plan TRACE --budget SIZE`` makes one).
"""

from __future__ import annotations

from typing import Any

from memdoctor.plan.cards import CONTEXT_RESERVE_BYTES
from memdoctor.plan.model import workload
from memdoctor.plan.ninegrid import ninegrid, priority
from memdoctor.plan.planner import Target, card_table, make_plan
from memdoctor.plan.rules import RuleInput, run_rules
from memdoctor.trace import Trace


def summary_target(summary: dict[str, Any]) -> Target | None:
    """The budget the run was judged against: ``--budget``/cap as given, else the GPU less its context."""
    device = summary.get("device") or {}
    budget = summary.get("budget_bytes") or device.get("memory_cap_bytes")
    if budget:
        return Target(int(budget))
    total = device.get("total_memory_bytes")
    if device.get("kind") == "cuda" and total:
        return Target(int(total) - CONTEXT_RESERVE_BYTES)
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
    plan = make_plan(w, target, order).as_dict() if w is not None and target is not None else None
    return {
        "ninegrid": grid,
        "lever_priority": ranked,
        "findings": findings,
        "plan": plan,
        "reason": reason,
        "workload": w,
    }


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``ninegrid``, ``lever_priority``, ``findings`` and ``plan`` (null when there is no budget or no
    memory figure)."""
    out = doctor(trace, summary, summary_target(summary))
    summary["ninegrid"] = out["ninegrid"]
    summary["lever_priority"] = out["lever_priority"]
    summary["findings"] = out["findings"]
    summary["plan"] = out["plan"]


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The plan, the findings, the nine-grid and the card table; None when there is nothing to plan."""
    w = workload(trace, summary)
    if w is None:
        return None
    return {
        "plan": summary.get("plan"),
        "findings": summary.get("findings") or [],
        "ninegrid": summary.get("ninegrid") or {},
        "cards": card_table(w, priority=(summary.get("lever_priority") or {}).get("order")),
        "lever_priority": summary.get("lever_priority"),
        "notes": list(w.notes),
        "context_reserve_bytes": CONTEXT_RESERVE_BYTES,
        "reason": None if summary.get("plan") else "no budget: this run had no --budget and no GPU",
    }
