"""Pure functions from a trace to data: summary.json's figures, one module per collector, named like it.
Imports trace and the base modules only: no torch, no matplotlib, no report (docs/architecture.md).
"""

from __future__ import annotations

from memdoctor.analysis.faults import fault_info, live_at_fault
from memdoctor.analysis.headline import headline
from memdoctor.analysis.layers import layer_table, top_layers
from memdoctor.analysis.steps import (
    categories_at_peak,
    peak_step,
    step_peak_bytes,
    step_rows,
    timeline_series,
)
from memdoctor.analysis.summary import SUMMARY_FORMAT_VERSION, summary_figures

__all__ = [
    "SUMMARY_FORMAT_VERSION",
    "categories_at_peak",
    "fault_info",
    "headline",
    "layer_table",
    "live_at_fault",
    "peak_step",
    "step_peak_bytes",
    "step_rows",
    "summary_figures",
    "timeline_series",
    "top_layers",
]
