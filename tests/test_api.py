"""The in-process API: ``with memdoctor.profile(...)`` writes the same trace, report and summary as the
command line, removes everything it installed (the autouse fixture checks hooks, patches and threads),
and records an exception raised in the block before re-raising it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import memdoctor
from memdoctor.errors import UsageError
from memdoctor.trace import load_trace


def _train(steps: int, fail_at: int | None = None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        if i == fail_at:
            raise RuntimeError("planted failure")
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_profile_block_writes_trace_report_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with memdoctor.profile(out, steps=2, warmup=1, collect="none") as prof:
        _train(6)  # more steps than profiled: profiling stops at 3, training carries on
    assert prof.status == "completed"
    assert prof.report_path is not None and prof.report_path.is_file()
    assert prof.summary is not None and prof.summary["steps_profiled"] == 2
    trace = load_trace(out / "trace.jsonl.gz")
    assert trace.end is not None and trace.end["status"] == "completed"
    assert [s.step for s in trace.steps] == [0, 1, 2]
    assert trace.header["command"]["in_process"] is True
    assert not (out / "trace.jsonl.gz.partial").exists()


def test_block_ending_early_keeps_what_was_measured(tmp_path: Path) -> None:
    with memdoctor.profile(tmp_path / "o", steps=5, warmup=0, collect="none") as prof:
        _train(2)
    assert prof.status == "script_finished"
    assert prof.summary is not None and prof.summary["steps_profiled"] == 2


def test_exception_in_block_is_recorded_and_reraised(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with pytest.raises(RuntimeError, match="planted failure"), memdoctor.profile(out, steps=5, warmup=0):
        _train(5, fail_at=2)
    trace = load_trace(out / "trace.jsonl.gz")
    assert trace.end is not None and trace.end["status"] == "exception"
    assert "planted failure" in trace.end["message"]
    assert sum(1 for s in trace.steps if s.complete) == 2
    assert (out / "report.html").is_file()
    assert any(e["kind"] == "exception" for e in trace.events)


def test_existing_output_is_not_overwritten_without_force(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.html").write_text("mine")
    with pytest.raises(UsageError), memdoctor.profile(out, steps=1, warmup=0, collect="none"):
        _train(1)
    assert (out / "report.html").read_text() == "mine"


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown collector"):
        memdoctor.profile(collect="nope")
    with pytest.raises(UsageError, match="steps"):
        memdoctor.profile(steps=0)


def test_report_salvages_an_unfinished_in_process_trace(tmp_path: Path) -> None:
    from memdoctor.cli import main

    prof = memdoctor.profile(tmp_path / "o", steps=3, warmup=0, collect="none")
    prof.__enter__()
    try:
        _train(2)
    finally:  # a hard crash: the block never exits, so no end record is written
        prof._session.stop()
        prof._writer.close()
    partial = tmp_path / "o" / "trace.jsonl.gz.partial"
    assert main(["report", str(partial), "-o", str(tmp_path / "r")]) == 3  # refused without --salvage
    assert main(["report", "--salvage", str(partial), "-o", str(tmp_path / "r")]) == 0
    html = (tmp_path / "r" / "report.html").read_text()
    assert "no end record" in html
