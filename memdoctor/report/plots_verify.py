"""The "Measured vs predicted" section's chart: predicted and measured peak per verified round.

Same conventions as ``memdoctor.report.plots`` (matplotlib's object API, deterministic SVG data URIs).
"""

from __future__ import annotations

from typing import Any

import matplotlib

from memdoctor.report.plots import _RC, _figure, byte_unit, svg_data_uri

PREDICTED_COLOR = "#bab0ac"
MEASURED_COLOR = "#4e79a7"
OVER_COLOR = "#e15759"
BUDGET_COLOR = "#b00020"


def peak_bars(rounds: list[dict[str, Any]], budget: int | None) -> str | None:
    """Two bars per round, predicted and measured peak (red when the round did not fit), and the budget
    as a dashed line. None without a round that has a figure to draw."""
    rows = [r for r in rounds if r.get("predicted_peak_bytes") or r.get("measured_peak_bytes")]
    if not rows:
        return None
    values = [float(r.get(k) or 0) for r in rows for k in ("predicted_peak_bytes", "measured_peak_bytes")]
    scale, unit = byte_unit(max([*values, float(budget or 0)]))
    x = list(range(len(rows)))
    with matplotlib.rc_context(_RC):
        fig = _figure(6.0, 2.6)
        ax = fig.axes[0]
        predicted = [float(r.get("predicted_peak_bytes") or 0) / scale for r in rows]
        measured = [float(r.get("measured_peak_bytes") or 0) / scale for r in rows]
        colors = [MEASURED_COLOR if r.get("fits") else OVER_COLOR for r in rows]
        ax.bar([i - 0.2 for i in x], predicted, width=0.38, color=PREDICTED_COLOR, label="predicted")
        ax.bar([i + 0.2 for i in x], measured, width=0.38, color=colors, label="measured")
        if budget:
            ax.axhline(budget / scale, color=BUDGET_COLOR, linestyle="--", linewidth=1.0, label="budget")
        ax.set_xticks(x, [f"round {r.get('round')}" for r in rows])
        ax.set_ylabel(unit)
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncols=3)
    return svg_data_uri(fig)
