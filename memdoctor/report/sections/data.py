"""The report's "Data" section: the loop's wait for batches against the step time, padding and the
real sequence lengths, and the batches' shapes."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.data import all_lengths, padded_lengths, shape_text
from memdoctor.report import plots_data
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The data section's context: wait per step against step time, padding and lengths, traits."""
    data = summary.get("data")
    if not isinstance(data, dict):
        return None
    lengths = all_lengths(trace)
    return {
        **data,
        "wait_fraction": summary.get("dataloader_wait_fraction"),
        "padding_fraction": summary.get("padding_fraction"),
        "wait_chart": plots_data.wait_chart(data["steps"]) if data["wait"] else None,
        "length_chart": plots_data.length_histogram(lengths, padded_lengths(trace), data["lengths"]),
        "shape_rows": [
            {"step": row["step"], "shapes": [shape_text({"shapes": s}) for s in row["shapes"]]}
            for row in data["steps"]
        ],
    }
