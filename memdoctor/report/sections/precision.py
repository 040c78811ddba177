"""The report's "Mixed precision" section: the verdict, its findings, the layers most at risk and the
histograms as a heatmap."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.histograms import chart_data, entries, riskiest
from memdoctor.analysis.precision_rules import NEAR_ZERO_LOG2
from memdoctor.report import plots_precision
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The report's precision section: verdict, findings, riskiest layers and the histogram chart."""
    result = summary.get("precision")
    if result is None:
        return None
    found = entries(trace)
    chart = chart_data(trace, found)
    return {
        "result": result,
        "rows": riskiest(found),
        "chart": plots_precision.histogram_heatmap(chart) if chart else None,
        "chart_layers": len(chart["layers"]) if chart else 0,
        "chart_of": chart["shown_of"] if chart else 0,
        "near_zero_log2": NEAR_ZERO_LOG2,
    }
