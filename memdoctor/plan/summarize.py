"""The plan section: the nine-grid, the rules' findings and the plan for the run's budget.

``summarize`` adds ``ninegrid``, ``findings`` and ``plan`` to ``summary.json`` (it runs after the other
sections, whose keys it reads). The budget is the run's ``--budget`` (or memory cap) when it had one,
else the profiled GPU's memory less the CUDA context reserve; a CPU run without a budget has no plan
(``plan`` null; ``memdoctor plan TRACE --budget SIZE`` makes one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from memdoctor.analysis.data import PADDING_HIGH, PADDING_NOTABLE
from memdoctor.analysis.flops import LOW_SHARE
from memdoctor.analysis.verified import chosen_round, rounds
from memdoctor.cards import CONTEXT_RESERVE_BYTES
from memdoctor.plan.alternatives import alternatives
from memdoctor.plan.model import workload
from memdoctor.plan.ninegrid import STATE_HIGH, STATE_LOW, ninegrid, priority
from memdoctor.plan.planner import card_table, make_plan
from memdoctor.plan.reprofiled import advice as reprofile_advice
from memdoctor.plan.reprofiled import summary_record as reprofile_record
from memdoctor.plan.rules import RuleInput, run_rules
from memdoctor.plan.target import Target
from memdoctor.plan.workload import corrected_workload
from memdoctor.trace import Trace
from memdoctor.units import format_bytes


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
    plan = None
    if w is not None and target is not None:
        choice = verified_choice(trace)
        pw = corrected_workload(w, choice.correction) if choice.correction > 1.0 else w
        searched = target if choice.margin is None else replace(target, margin=choice.margin)
        made = make_plan(pw, searched, order, avoid=choice.avoided)
        plan = {**made.as_dict(), "alternatives": alternatives(pw, searched, made)}
        if choice.round is not None:
            plan["advice"].insert(0, _verified_advice(choice))
        reprofiled = reprofile_record(trace)
        if reprofiled is not None:
            plan["advice"].insert(0, reprofile_advice(reprofiled))
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


def verified_choice(trace: Trace) -> Search:
    """The search of the plan ``profile --verify`` measured into the plan, when it is not the first
    one: a re-plan that fitted (its memory predictions raised by ``correction``), or a compared plan
    without ``avoided`` that measured faster (``chosen_round``), searched with the safety ``margin`` it
    records. The plan of the report and of memdoctor.yaml is then that round's: the same search, with
    the same factor, margin and family left out. ``Search()`` when the first plan stands."""
    best = chosen_round(rounds(trace))
    if best is None:
        return Search()
    factor = float(best["correction"] or 1.0)
    avoided = best["avoided"]
    if factor <= 1.0 and not avoided:
        return Search()
    margin = best["margin"]
    return Search(factor, avoided, int(best["round"]), None if margin is None else float(margin))


def _verified_advice(choice: Search) -> str:
    parts = []
    if choice.correction > 1.0:
        parts.append(
            f"re-planned with memory predictions raised x{choice.correction:.2f}: the first plan's verified "
            "run needed more memory than predicted"
        )
    if choice.avoided:
        parts.append(
            f"the best plan without {choice.avoided} measured a shorter step than the first plan that fitted"
        )
    return f"the plan verify round {choice.round} measured (Measured vs predicted): " + "; and ".join(parts)


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``ninegrid``, ``lever_priority``, ``findings`` and ``plan`` (null when there is no budget or no
    memory figure)."""
    out = doctor(trace, summary, summary_target(summary))
    summary["ninegrid"] = out["ninegrid"]
    summary["lever_priority"] = out["lever_priority"]
    summary["findings"] = out["findings"]
    summary["plan"] = out["plan"]
    summary["reprofile"] = reprofile_record(trace)


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The plan, the findings, the nine-grid and the card table; None when there is nothing to plan."""
    w = workload(trace, summary)
    if w is None:
        return None
    from memdoctor.report import plots_plan  # the report layer draws; analysis stays importable without it

    return {
        "plan": summary.get("plan"),
        "findings": by_saving(summary.get("findings") or []),
        "ninegrid": summary.get("ninegrid") or {},
        "ninegrid_rows": ninegrid_rows(summary.get("ninegrid") or {}),
        "ninegrid_chart": plots_plan.ninegrid(summary.get("ninegrid") or {}),
        "cards": card_table(w, priority=(summary.get("lever_priority") or {}).get("order")),
        "lever_priority": summary.get("lever_priority"),
        "notes": list(w.notes),
        "context_reserve_bytes": CONTEXT_RESERVE_BYTES,
        "reason": None if summary.get("plan") else "no budget: this run had no --budget and no GPU",
    }


def by_saving(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings by expected saving, largest first (a finding without a saving last); ties keep rule order."""
    return sorted(findings, key=lambda f: -(f.get("saving_bytes") or 0))


def ninegrid_rows(grid: dict[str, Any]) -> list[dict[str, Any]]:
    """The nine-grid's axes as table rows: level, the raw figure, the thresholds it was judged by, and the
    evidence (or why the axis was not measured)."""
    rows = []
    for key, label in (
        ("compute", "compute intensity"),
        ("parameter_scale", "parameter scale"),
        ("data", "data traits"),
    ):
        axis = grid.get(key) or {}
        figs = axis.get("figures") or {}
        rows.append(
            {
                "axis": label,
                "level": axis.get("level"),
                "figure": _FIGURES[key](figs) if axis.get("level") else None,
                "thresholds": _THRESHOLDS[key](figs),
                "evidence": axis.get("evidence") or "",
            }
        )
    return rows


def _compute_figure(figs: dict[str, Any]) -> str | None:
    ai, ridge = figs.get("arithmetic_intensity"), figs.get("ridge_point")
    if ai is None:
        return None
    return f"{ai:.3g} FLOP/byte" + (f", {ai / ridge:.2f}x the ridge point {ridge:.3g}" if ridge else "")


def _compute_thresholds(figs: dict[str, Any]) -> str:
    ridge = figs.get("ridge_point")
    if not ridge:
        return f"low < {LOW_SHARE:g} x ridge point <= medium < ridge point <= high"
    return f"low < {LOW_SHARE * ridge:.3g} <= medium < {ridge:.3g} <= high (FLOP/byte)"


def _state_figure(figs: dict[str, Any]) -> str | None:
    if figs.get("share") is None:
        return None
    state, budget = format_bytes(figs["model_state_bytes"]), format_bytes(figs["budget_bytes"])
    return f"{state} of {budget}: {figs['share']:.1%}"


def _state_thresholds(figs: dict[str, Any]) -> str:
    return f"low < {STATE_LOW:.0%} <= medium < {STATE_HIGH:.0%} <= high (model state / budget)"


def _data_figure(figs: dict[str, Any]) -> str | None:
    padding = figs.get("padding_fraction")
    text = f"{figs['class']}" if figs.get("class") else ""
    return text + (f", {padding:.1%} padding" if padding is not None else "") or None


def _data_thresholds(figs: dict[str, Any]) -> str:
    return (
        f"low: fixed shape; medium: padding >= {PADDING_NOTABLE:.0%} or varying shapes; "
        f"high: padding >= {PADDING_HIGH:.0%}"
    )


_FIGURES = {"compute": _compute_figure, "parameter_scale": _state_figure, "data": _data_figure}
_THRESHOLDS = {"compute": _compute_thresholds, "parameter_scale": _state_thresholds, "data": _data_thresholds}
