"""``summary.json``: what analysis measured, then the plan, which reads it, then the headline.

The report owns the whole file because it sits above both: analysis may not import the plan
(``docs/architecture.md``), and the plan's ``summarize`` reads the keys the analysis sections add.
"""

from __future__ import annotations

import json
from typing import Any

from memdoctor.analysis.headline import headline
from memdoctor.analysis.summary import summary_figures
from memdoctor.plan import summarize as plan_summary
from memdoctor.trace import Trace

SUMMARY_FILENAME = "summary.json"


def build_summary(trace: Trace) -> dict[str, Any]:
    """The content of ``summary.json``: the analysis figures, the plan (``ninegrid``, ``findings``,
    ``plan``, ...) and the one-sentence ``headline``."""
    summary = summary_figures(trace)
    plan_summary.summarize(trace, summary)
    summary["headline"] = headline(summary)
    return summary


def summary_json(summary: dict[str, Any]) -> str:
    """``summary.json``'s text: sorted keys, two-space indent, strict JSON."""
    return json.dumps(summary, sort_keys=True, indent=2, allow_nan=False) + "\n"
