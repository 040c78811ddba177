"""Pure analysis of a trace: the summary (``summary.json``) and the tables the report draws."""

from __future__ import annotations

from memdoctor.analysis.summary import (
    SUMMARY_FORMAT_VERSION,
    build_summary,
    categories_at_peak,
    fault_info,
    headline,
    layer_table,
    live_at_fault,
    peak_step,
    step_peak_bytes,
    step_rows,
    timeline_series,
    top_layers,
)

__all__ = [
    "SUMMARY_FORMAT_VERSION",
    "build_summary",
    "categories_at_peak",
    "fault_info",
    "headline",
    "layer_table",
    "live_at_fault",
    "peak_step",
    "step_peak_bytes",
    "step_rows",
    "timeline_series",
    "top_layers",
]
