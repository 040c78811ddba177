"""summary.json and the HTML report: every chart and template context, from what analysis and plan return.
Imports config, plan, analysis and trace; computes no figure of its own (docs/architecture.md).
"""

from __future__ import annotations

from memdoctor.report.render import render_report, write_report
from memdoctor.report.summary import SUMMARY_FILENAME, build_summary, summary_json

__all__ = ["SUMMARY_FILENAME", "build_summary", "render_report", "summary_json", "write_report"]
