"""The plan section's chart: the nine-grid, with the workload's cell highlighted.

Compute intensity (x) by parameter scale (y), each low / medium / high, and the third axis, data traits,
as a strip beside the grid. An axis the trace did not measure is drawn hatched with "not measured": its
whole row, column or strip stays a possibility rather than a guess.
"""

from __future__ import annotations

from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from memdoctor.report.plots import _RC, COLORS, LABELS, _figure, byte_unit, svg_data_uri
from memdoctor.units import format_bytes

LEVELS = ("low", "medium", "high")
HIT = "#e15759"
CELL = "#f1f1f4"
UNKNOWN = "#f6d5d6"
# Tick labels: the level and its threshold (memdoctor.analysis.flops.LOW_SHARE,
# memdoctor.plan.ninegrid.STATE_LOW/STATE_HIGH, memdoctor.analysis.data.PADDING_NOTABLE/PADDING_HIGH).
COMPUTE_TICKS = ("low\n< ¼ ridge point", "medium\n¼ ridge – ridge", "high\n≥ ridge point")
STATE_TICKS = ("low\n< 25% of budget", "medium\n25–60%", "high\n≥ 60%")
DATA_TICKS = ("low\nfixed shape", "medium\npadding ≥ 5%\nor varying", "high\npadding ≥ 30%")


def ninegrid(grid: dict[str, Any]) -> str:
    """The 3×3 grid (compute × parameter scale) and the data-traits strip, as an SVG data URI."""
    compute, state, data = (grid.get(k) or {} for k in ("compute", "parameter_scale", "data"))
    cx, sy = _index(compute), _index(state)
    with matplotlib.rc_context(_RC):
        fig = matplotlib.figure.Figure(figsize=(8.6, 4.6), layout="constrained")
        main, strip = fig.subplots(1, 2, width_ratios=(3.0, 1.0))
        _cells(main, cx, sy, _cell_text(compute, state, data))
        _axis_labels(main, compute, state)
        _strip(strip, data)
    return svg_data_uri(fig)


def _index(axis: dict[str, Any]) -> int | None:
    level = axis.get("level")
    return LEVELS.index(level) if level in LEVELS else None


def _cells(ax: Axes, cx: int | None, sy: int | None, text: str) -> None:
    """Nine cells; the workload's is filled; an unmeasured axis hatches every cell it could be."""
    for x in range(3):
        for y in range(3):
            hit_x, hit_y = (cx is None or cx == x), (sy is None or sy == y)
            known = cx is not None and sy is not None
            if hit_x and hit_y:
                face, hatch = (HIT, None) if known else (UNKNOWN, "///")
            else:
                face, hatch = CELL, None
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="white", linewidth=3, hatch=hatch))
    where = ((cx if cx is not None else 1) + 0.5, (sy if sy is not None else 1) + 0.5)
    ax.text(*where, text, ha="center", va="center", fontsize=8, color="#1d1d1f", wrap=True)
    ax.set_xlim(0, 3)
    ax.set_ylim(0, 3)
    ax.set_xticks([0.5, 1.5, 2.5], COMPUTE_TICKS, fontsize=7.5)
    ax.set_yticks([0.5, 1.5, 2.5], STATE_TICKS, fontsize=7.5)
    ax.tick_params(length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)


def _cell_text(compute: dict[str, Any], state: dict[str, Any], data: dict[str, Any]) -> str:
    """What the highlighted cell says: this run's figures, and which axes were not measured."""
    lines = ["this run"]
    lines.append(_compute_figure(compute) or "compute intensity\nnot measured")
    lines.append(_state_figure(state) or "parameter scale\nnot measured")
    lines.append(f"data traits: {data['level']}" if data.get("level") else "data traits not measured")
    return "\n".join(lines)


def _compute_figure(axis: dict[str, Any]) -> str | None:
    figs = axis.get("figures") or {}
    ai, ridge = figs.get("arithmetic_intensity"), figs.get("ridge_point")
    if not axis.get("level") or not ai:
        return None
    return f"{ai:.3g} FLOP/byte" + (f"\n= {ai / ridge:.2f}× ridge point" if ridge else "")


def _state_figure(axis: dict[str, Any]) -> str | None:
    figs = axis.get("figures") or {}
    if not axis.get("level") or figs.get("share") is None:
        return None
    return f"model state {format_bytes(figs['model_state_bytes'])}\n= {figs['share']:.0%} of budget"


def _axis_labels(ax: Axes, compute: dict[str, Any], state: dict[str, Any]) -> None:
    x = "compute intensity (FLOP per byte vs the device's ridge point)"
    y = "parameter scale (model state / budget)"
    ax.set_xlabel(x if compute.get("level") else x + ": NOT MEASURED", fontsize=8.5)
    ax.set_ylabel(y if state.get("level") else y + ": NOT MEASURED", fontsize=8.5)


def _strip(ax: Axes, data: dict[str, Any]) -> None:
    """Data traits, the third axis: three stacked segments, the workload's filled (hatched: unmeasured)."""
    level = _index(data)
    for y in range(3):
        face, hatch = (HIT, None) if level == y else (CELL, None)
        if level is None:
            face, hatch = UNKNOWN, "///"
        ax.add_patch(Rectangle((0, y), 1, 1, facecolor=face, edgecolor="white", linewidth=3, hatch=hatch))
    if level is None:
        ax.text(0.5, 1.5, "not\nmeasured", ha="center", va="center", fontsize=8)
    else:
        padding = (data.get("figures") or {}).get("padding_fraction")
        label = "this run" + (f"\n{padding:.1%}\npadding" if padding is not None else "")
        ax.text(0.5, level + 0.5, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 3)
    ax.set_xticks([])
    ax.set_yticks([0.5, 1.5, 2.5], DATA_TICKS, fontsize=7.5)
    ax.yaxis.tick_right()
    ax.tick_params(length=0)
    ax.set_xlabel("data traits", fontsize=8.5)
    for side in ("left", "bottom", "right", "top"):
        ax.spines[side].set_visible(False)


# How a bar of ``peak_parts`` is drawn by its kind: a measured figure solid, an extrapolated one hatched,
# a predicted one pale and dotted, so the chart never shows a prediction as if it had been measured.
KIND_STYLE: dict[str, dict[str, Any]] = {
    "measured": {"alpha": 1.0},
    "extrapolated": {"alpha": 0.8, "hatch": "///"},
    "predicted": {"alpha": 0.45, "hatch": "..."},
}


def peak_parts(bars: list[dict[str, Any]], budget: int | None) -> str | None:
    """Horizontal stacked bars, one per peak of ``memdoctor.report.peaks.peak_parts`` (allocated bytes by
    category, first on top), each labelled with its kind, and the budget dashed. None without bars."""
    if not bars:
        return None
    scale, unit = byte_unit(max([*(b["total"] for b in bars), budget or 0]))
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 1.2 + 0.42 * len(bars))
        ax = fig.axes[0]
        y = list(range(len(bars)))
        left = [0.0] * len(bars)
        for cat in ("parameters", "gradients", "optimizer_state", "activations", "other"):
            for i, b in enumerate(bars):
                width = b["parts"][cat] / scale
                style = KIND_STYLE.get(b["kind"], {})
                label = LABELS[cat] if i == 0 else None
                ax.barh(
                    i,
                    width,
                    left=left[i],
                    color=COLORS[cat],
                    edgecolor="white",
                    height=0.7,
                    label=label,
                    **style,
                )
                left[i] += width
        for i, b in enumerate(bars):
            note = f"{format_bytes(b['total'])} {b['kind']}" + (
                " (total only)" if b["parts"]["other"] == b["total"] else ""
            )
            ax.annotate(
                note, (left[i], i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8
            )
        if budget:
            ax.axvline(budget / scale, color="#b00020", linestyle="--", linewidth=1.0)
            ax.annotate(
                f"budget {format_bytes(budget)}",
                (budget / scale, len(bars) - 0.5),
                color="#b00020",
                xytext=(3, 0),
                textcoords="offset points",
                fontsize=8,
                va="bottom",
            )
        ax.set_yticks(y, [b["label"] for b in bars])
        ax.invert_yaxis()
        ax.set_xlim(0, max([*left, (budget or 0) / scale]) * 1.25)
        ax.set_xlabel(f"allocated memory ({unit}) at each peak")
        ax.legend(loc="lower right", frameon=False, ncols=5, bbox_to_anchor=(1.0, 1.0))
    return svg_data_uri(fig)
