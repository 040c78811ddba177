"""The report's "Host<->device transfers" section: what each step moved over PCIe, where, and what it
cost, against the measured bandwidth."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.transfers import collector_notes, link_figures, pcie_samples
from memdoctor.report import plots_transfers
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """Per-step bytes and time, the biggest copies and sync reads by where they happen, pageable vs
    pinned, and the measured bandwidth against the link's; None when transfers were not measured."""
    xfer = summary.get("transfers")
    if not xfer:
        return None
    return {
        "x": xfer,
        "h2d_bytes_per_step": summary.get("h2d_bytes_per_step"),
        "d2h_bytes_per_step": summary.get("d2h_bytes_per_step"),
        "link": link_figures(trace, summary),
        "chart": plots_transfers.bytes_per_step(xfer["steps"]),
        "pcie_chart": plots_transfers.pcie_throughput(pcie_samples(trace)),
        "notes": collector_notes(trace),
    }
