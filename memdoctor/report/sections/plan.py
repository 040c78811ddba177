"""The report's plan section: the plan for the run's budget, the rules' findings by saving, the nine-grid
(its chart and its axes as table rows) and the card table."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from memdoctor.analysis.data import PADDING_HIGH, PADDING_NOTABLE
from memdoctor.analysis.flops import LOW_SHARE
from memdoctor.cards import CONTEXT_RESERVE_BYTES, Card, find_card
from memdoctor.errors import UsageError
from memdoctor.plan.model import workload
from memdoctor.plan.ninegrid import STATE_HIGH, STATE_LOW
from memdoctor.plan.planner import card_table
from memdoctor.report import plots_plan
from memdoctor.report.peaks import peak_parts, peak_rows
from memdoctor.trace import PARTIAL_SUFFIX, Trace
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
        "cards": card_rows(trace, card_table(w, priority=(summary.get("lever_priority") or {}).get("order"))),
        "measured_for": measured_for(summary),
        "lever_priority": summary.get("lever_priority"),
        "notes": list(w.notes),
        "peaks": peak_rows(trace, summary),
        "peaks_chart": plots_plan.peak_parts(
            peak_parts(trace, summary), (summary.get("plan") or {}).get("budget_bytes")
        ),
        "context_reserve_bytes": CONTEXT_RESERVE_BYTES,
        "reason": None if summary.get("plan") else "no budget: this run had no --budget and no GPU",
    }


def card_rows(trace: Trace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The card table's rows, each with the one command that writes that card's memdoctor.yaml, with
    absolute paths (it works from any folder): beside the trace, as ``memdoctor-KEY.yaml``."""
    path = getattr(trace, "path", None)
    saved = path is not None and not str(path).endswith(PARTIAL_SUFFIX)
    trace_path = Path(path).absolute() if saved and path else None
    out = []
    for row in rows:
        key = row.get("gpu")
        if key is None:
            out.append(row)
            continue
        target = trace_path.parent / f"memdoctor-{key}.yaml" if trace_path else Path(f"memdoctor-{key}.yaml")
        words = ["memdoctor", "plan", "--gpu", key, str(trace_path or "TRACE"), "-o", str(target)]
        out.append({**row, "command": shlex.join(words)})
    return out


def measured_for(summary: dict[str, Any]) -> str | None:
    """One sentence: which device measured (and under what cap), and which card the plan is for, with
    the features it was planned with; None without a plan."""
    plan = summary.get("plan")
    if not plan:
        return None
    device = summary.get("device") or {}
    cpu = device.get("kind") != "cuda"
    measured = "the CPU" if cpu else str(device.get("name") or "an unnamed GPU")
    cap = device.get("memory_cap_bytes")
    where = f"Measured on {measured}" + (f", capped to {format_bytes(cap)}" if cap else "")
    card = _card(plan.get("card"))
    if card is None:
        return (
            f"{where}; planned for a {format_bytes(plan['budget_bytes'])} budget with the measured "
            "device's own features (profile or plan with --gpu NAME to plan for a card's features)."
        )
    uncapped = " (not capped: a CPU run cannot be; the plan applies the card's size to what it measured)"
    uncapped = uncapped if cpu else ""
    return (
        f"{where}{uncapped}; planned for the {card.name}: {format_bytes(plan['budget_bytes'])} of its "
        f"{format_bytes(card.memory_bytes)}, {_features(card)}."
    )


def _card(name: Any) -> Card | None:
    if not isinstance(name, str):
        return None
    try:
        return find_card(name)
    except UsageError:
        return None


def _features(card: Card) -> str:
    """The card's features the planner uses: 16-bit path, host link, FLOP rate."""
    cc = ".".join(map(str, card.capability))
    if card.bf16:
        precision = f"native bf16 (compute capability {cc})"
    elif card.fp16_tensor_cores:
        precision = f"no bf16 (compute capability {cc}): fp16 with a GradScaler where the ranges allow"
    else:
        precision = f"no bf16 and no fp16 tensor cores (compute capability {cc})"
    link = f"PCIe Gen{card.pcie_gen} at {card.pcie_bytes_per_s / 1e9:.1f} GB/s for offload"
    if card.peaks is None:
        rate = "no datasheet FLOP rate listed, so the time model uses the profiled GPU's"
    else:
        fp32, fp16 = card.peaks.float32 / 1e12, card.peaks.float16 / 1e12
        rate = f"{fp32:.3g} TFLOP/s fp32 and {fp16:.3g} TFLOP/s 16-bit for the time model"
    return f"{precision}; {link}; {rate}"


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
