"""The report's "Compute intensity" section: the counted step's FLOPs and bytes, its place on the
roofline, and the modules that run the most FLOPs, charted by arithmetic intensity."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.flops import flop_step, module_table, not_measured_reason
from memdoctor.report import plots_compute
from memdoctor.trace import Trace

TOP_MODULES = 20


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """The compute section's context; ``measured`` False carries the reason it was not measured."""
    compute = summary.get("compute")
    if compute is None or flop_step(trace) is None:
        return {"measured": False, "reason": not_measured_reason(trace)}
    modules = module_table(trace, compute)
    roof = compute["roofline"]
    return {
        "measured": True,
        "c": compute,
        "modules": modules[:TOP_MODULES],
        "more_modules": max(0, len(modules) - TOP_MODULES),
        "chart": plots_compute.intensity_scatter(
            modules, roof["ridge_point"] if roof else None, compute["arithmetic_intensity"]
        ),
    }
