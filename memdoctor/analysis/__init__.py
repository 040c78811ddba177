"""Pure analysis of a trace: ``summary.json``'s figures and the tables the report draws.

One module per collector adds its keys (``summary.SECTIONS``); the report assembles the whole
``summary.json`` with the plan (``memdoctor.report.build_summary``).
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
