"""The merged report's chart: each rank's measured peak and median step time, side by side.

Same conventions as ``memdoctor.report.plots`` (matplotlib's object API, deterministic SVG data URIs).
The rank that failed first is drawn red and any other rank that did not end well amber (in a torchrun
job those are usually stopped because of the first), so the eye finds the culprit before reading the
table; a rank without a figure is named "not measured" where its bar would be, never drawn as a zero.
"""

from __future__ import annotations

from typing import Any

import matplotlib
from matplotlib.figure import Figure

from memdoctor.report.plots import _RC, byte_unit, svg_data_uri

BAR_COLOR = "#4e79a7"
FAILED_COLOR = "#e15759"
STOPPED_COLOR = "#f2b447"
BUDGET_COLOR = "#b00020"


def rank_bars(rows: list[dict[str, Any]], failed_first: int | None, failed: frozenset[str]) -> str | None:
    """Two bar charts over the ranks, peak memory and median step time (both measured); ``failed``:
    the statuses of a rank that did not end well. None when no rank has either figure."""
    if not any(r["peak_memory_bytes"] is not None or r["step_time_ms"] is not None for r in rows):
        return None
    colors = [
        FAILED_COLOR if r["rank"] == failed_first else STOPPED_COLOR if r["status"] in failed else BAR_COLOR
        for r in rows
    ]
    budgets = {r["budget_bytes"] for r in rows if r["budget_bytes"] is not None}
    peaks = [r["peak_memory_bytes"] for r in rows]
    scale, unit = byte_unit(max([*(p or 0 for p in peaks), *budgets, 1]))
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(9.0, 3.0), layout="constrained")
        memory, time = fig.subplots(1, 2)
        _bars(memory, rows, [None if p is None else p / scale for p in peaks], colors)
        memory.set_title("peak memory per rank (measured)", fontsize=9, loc="left")
        memory.set_ylabel(f"memory ({unit})")
        if len(budgets) == 1:
            budget = budgets.pop() / scale
            memory.axhline(budget, color=BUDGET_COLOR, linestyle="--", linewidth=1.0, label="budget")
            memory.legend(loc="lower right", frameon=False, bbox_to_anchor=(1.0, 1.0))
        _bars(time, rows, [r["step_time_ms"] for r in rows], colors)
        time.set_title("median step time per rank (measured)", fontsize=9, loc="left")
        time.set_ylabel("ms")
    return svg_data_uri(fig)


def _bars(ax: Any, rows: list[dict[str, Any]], values: list[float | None], colors: list[str]) -> None:
    x = list(range(len(rows)))
    ax.bar(x, [v or 0.0 for v in values], color=colors, width=0.7)
    top = max([v for v in values if v is not None] or [1.0])
    for i, v in enumerate(values):
        if v is None:
            ax.annotate(
                "not measured",
                (i, 0),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                rotation=90,
                va="bottom",
                fontsize=8,
                color="#6b6b70",
                fontstyle="italic",
            )
    ax.set_xticks(x, [str(r["rank"]) for r in rows], fontsize=8 if len(rows) > 16 else None)
    ax.set_xlabel("rank")
    ax.set_ylim(0, top * 1.12)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
