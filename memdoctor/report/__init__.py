"""``summary.json`` and the HTML report: drawing and templating only; the figures come from analysis
and the plan."""

from __future__ import annotations

from memdoctor.report.render import render_report, write_report
from memdoctor.report.summary import SUMMARY_FILENAME, build_summary, summary_json

__all__ = ["SUMMARY_FILENAME", "build_summary", "render_report", "summary_json", "write_report"]
