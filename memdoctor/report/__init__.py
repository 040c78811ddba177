"""The HTML report and ``summary.json``: drawing and templating only; the figures come from analysis."""

from __future__ import annotations

from memdoctor.report.render import render_report, summary_json, write_report

__all__ = ["render_report", "summary_json", "write_report"]
