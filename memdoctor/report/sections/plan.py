"""The report's plan section: the plan for the run's budget, the rules' findings by saving, the nine-grid
(its chart and its axes as table rows) and the card table."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.data import PADDING_HIGH, PADDING_NOTABLE
from memdoctor.analysis.flops import LOW_SHARE
from memdoctor.cards import CONTEXT_RESERVE_BYTES
from memdoctor.plan.model import workload
from memdoctor.plan.ninegrid import STATE_HIGH, STATE_LOW
from memdoctor.plan.planner import card_table
from memdoctor.report import plots_plan
from memdoctor.report.peaks import peak_parts, peak_rows
from memdoctor.trace import Trace
from memdoctor.units import format_bytes


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The plan, the findings, the nine-grid and the card table; None when there is nothing to plan."""
    w = workload(trace, summary)
    if w is None:
        return None
    return {
        "plan": summary.get("plan"),
        "findings": by_saving(summary.get("findings") or []),
        "ninegrid": summary.get("ninegrid") or {},
        "ninegrid_rows": ninegrid_rows(summary.get("ninegrid") or {}),
        "ninegrid_chart": plots_plan.ninegrid(summary.get("ninegrid") or {}),
        "cards": card_table(w, priority=(summary.get("lever_priority") or {}).get("order")),
        "lever_priority": summary.get("lever_priority"),
        "notes": list(w.notes),
        "peaks": peak_rows(trace, summary),
        "peaks_chart": plots_plan.peak_parts(
            peak_parts(trace, summary), (summary.get("plan") or {}).get("budget_bytes")
        ),
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
