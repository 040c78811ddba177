"""``summary.json``: what analysis measured, then the plan, which reads it, then the headline.

The report owns the whole file because it sits above both: analysis may not import the plan
(``docs/architecture.md``), and the plan's ``summarize`` reads the keys the analysis sections add.
"""

from __future__ import annotations

import json
from typing import Any

from memdoctor.analysis.headline import headline
from memdoctor.analysis.summary import shown_events, summary_figures
from memdoctor.plan import summarize as plan_summary
from memdoctor.trace import Trace

SUMMARY_FILENAME = "summary.json"


def build_summary(trace: Trace) -> dict[str, Any]:
    """The content of ``summary.json``: the analysis figures, the plan (``ninegrid``, ``findings``,
    ``plan``, ...) and the one-sentence ``headline``."""
    with trace.frozen():  # what every section asks of all steps (the peak step ...) is found once
        summary = summary_figures(trace)
        plan_summary.summarize(trace, summary)
    summary["headline"] = headline(summary)
    return summary


def embedded_summary(summary: dict[str, Any], rows: int) -> dict[str, Any]:
    """``summary.json`` as ``report.html`` embeds it: each per-step list (``ROW_KEYS``) cut to ``rows``
    rows (the first and last halves, as the report's step table shows them), and ``rows_left_out``
    counting what was cut, per key (absent when nothing was). The whole summary of 100,000 steps would
    be most of a 24 MB report; ``summary.json`` beside it keeps every row."""
    out, left = dict(summary), {}
    for key in ROW_KEYS:
        items = summary.get(key)
        if isinstance(items, list) and len(items) > rows:
            out[key] = [items[i] for i in shown_events(len(items), rows)]
            left[key] = len(items) - rows
    if left:
        out["rows_left_out"] = left
    return out


# Top-level lists with a row per step: written a row to a line (see ``summary_json``).
ROW_KEYS = ("steps", "grad_norm")
_ROW_MARK = "\x00rows"
# One encoder for every row (``json.dumps`` makes one a row).
_ROW_ENCODER = json.JSONEncoder(sort_keys=True, separators=(", ", ": "), allow_nan=False)


def summary_json(summary: dict[str, Any]) -> str:
    """``summary.json``'s text: sorted keys, two-space indent, strict JSON; the rows of the per-step
    lists (``ROW_KEYS``) one to a line. Python's encoder indents in Python, a value at a time (about 30 s
    for 100,000 steps); a row to a line is its C encoder's work, once a row, and reads as a table."""
    rows = {k: summary[k] for k in ROW_KEYS if isinstance(summary.get(k), list) and summary[k]}
    text = json.dumps(
        {**summary, **dict.fromkeys(rows, _ROW_MARK)}, sort_keys=True, indent=2, allow_nan=False
    )
    for key, items in rows.items():
        # The marker's text ("\u0000rows") at the top level, after the key: nothing else can look so.
        mark = f"\n  {json.dumps(key)}: {json.dumps(_ROW_MARK)}"
        lines = ",\n    ".join(map(_ROW_ENCODER.encode, items))
        text = text.replace(mark, f"\n  {json.dumps(key)}: [\n    {lines}\n  ]", 1)
    return text + "\n"
