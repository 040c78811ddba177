"""The ``compiled`` summary object and its line, from crafted ``compile`` records (issue 19, point 7)."""

from __future__ import annotations

from typing import Any

import pytest

from memdoctor.analysis.compiled import compile_figures
from memdoctor.analysis.summary import summary_figures
from memdoctor.cli.terminal import _summary_rows
from memdoctor.trace import Trace
from tests.tracebuilder import completed_trace


def _with(record: Any) -> Trace:
    trace = completed_trace(kind="cpu", budget_bytes=None, layers=1)
    if record is not None:
        trace.collected["compile"] = record
    return trace


def _record(**over: Any) -> dict[str, Any]:
    rec = {"graphs": 2, "frames": 2, "frames_compiled": 2, "graph_breaks": 0, "break_reasons": []}
    return {**rec, **over}


def test_no_record_no_compiled_key_value() -> None:
    summary = summary_figures(_with(None))
    assert summary["compiled"] is None
    assert not any(key == "compiled" for key, _ in _summary_rows(summary, None, None))


def test_compiled_without_breaks_says_so_and_what_the_figures_mean() -> None:
    summary = summary_figures(_with(_record()))
    c = summary["compiled"]
    assert (c["graphs"], c["graph_breaks"]) == (2, 0)
    assert "ran compiled" in c["text"] and "no graph break" in c["text"]
    assert "one call of the module that called it" in c["text"]
    rows = dict(_summary_rows(summary, None, None))
    assert "ran compiled" in rows["compiled"]


def test_graph_breaks_are_counted_with_their_most_frequent_reason_and_cost() -> None:
    reasons = [{"reason": "Failed to trace builtin operator", "count": 3}, {"reason": "other", "count": 1}]
    c = compile_figures(_with(_record(graph_breaks=4, frames=3, break_reasons=reasons)))
    assert c is not None and c["graph_breaks"] == 4
    assert "4 graph break(s)" in c["text"] and "Failed to trace builtin operator" in c["text"]
    assert "1 frame(s) ran wholly eager" in c["text"] and "slower" in c["text"]
    assert "none from memdoctor's hooks" in c["text"]


def test_nothing_compiled_says_the_run_was_eager() -> None:
    c = compile_figures(_with(_record(graphs=0, frames=3, frames_compiled=0)))
    assert c is not None and "compiled nothing" in c["text"] and "eager" in c["text"]


@pytest.mark.parametrize(
    "record",
    [
        "not a dict",
        _record(graphs=-1),
        _record(graph_breaks=True),
        _record(frames="3"),
        {"graphs": 1},
    ],
)
def test_malformed_record_is_left_out(record: Any) -> None:
    assert compile_figures(_with(record)) is None


def test_malformed_reasons_are_dropped_not_fatal() -> None:
    reasons = [{"reason": 3, "count": 1}, "x", {"reason": "ok", "count": 1}]
    rec = _record(graph_breaks=1, break_reasons=reasons)
    c = compile_figures(_with(rec))
    assert c is not None and c["break_reasons"] == [{"reason": "ok", "count": 1}]


def test_breaks_at_memdoctors_optimizer_hooks_are_named_as_memdoctors() -> None:
    reasons = [{"reason": "Skip calling `torch.compiler.disable()`d function", "count": 2}]
    c = compile_figures(_with(_record(graph_breaks=3, memdoctor_breaks=2, break_reasons=reasons)))
    assert c is not None and c["memdoctor_breaks"] == 2
    assert "2 of them at memdoctor's optimizer-step hooks" in c["text"]
    assert "none from memdoctor's hooks" not in c["text"]
