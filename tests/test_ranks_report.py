"""The merged report of a multi-rank folder (issue 17, point 3), on ranks profiled in this process.

Two tiny models are profiled with ``memdoctor.profile()`` into ``rank-0/`` and ``rank-1/`` (rank 1 wider,
slower and failing at its fourth step), their headers then stamped with the ``distributed`` field a
launched rank records, rank 0's steps given measured collectives, and ``ranks.json`` written as the
launcher writes it. No child process, no GPU.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memdoctor
from memdoctor import exitcodes
from memdoctor.analysis import ranks as analysis
from memdoctor.cli import main
from memdoctor.errors import UsageError
from memdoctor.report.ranks import merged_summary, write_merged
from memdoctor.trace import StepRecord, Trace, load_trace, save_trace
from memdoctor.units import format_bytes

pytestmark = pytest.mark.fast

WORLD = 2
WHY = "exception: RuntimeError: planted failure"


def _train(width: int, steps: int, sleep_s: float, fail_at: int | None = None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        if i == fail_at:
            raise RuntimeError("planted failure")
        time.sleep(sleep_s)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _collectives(i: int) -> dict[str, Any]:
    """Rank 0's measured collectives of its step ``i``: an all-reduce and a broadcast, growing per step."""
    return {
        "ms": 0.5 + 0.1 * i,
        "calls": 3,
        "bytes": 4096,
        "by_op": {
            "all_reduce": {"ms": 0.4 + 0.1 * i, "calls": 2, "bytes": 4000},
            "<b>broadcast</b>": {"ms": 0.1, "calls": 1, "bytes": 96},
        },
    }


def _stamp(path: Path, rank: int, collectives: bool) -> None:
    """The trace's header as a launched rank writes it; measured collectives on its steps if asked."""
    trace = load_trace(path)
    trace.header["distributed"] = {
        "rank": rank,
        "world_size": WORLD,
        "local_rank": rank,
        "backend": "gloo",
        "master": "127.0.0.1:29500",
    }
    for i, step in enumerate(trace.steps):
        if collectives:
            step.collectors["collectives"] = _collectives(i)
    save_trace(trace, path)


def _launch(out: Path, world: int = WORLD) -> dict[str, Any]:
    ranks = [
        {
            "rank": 0,
            "status": "killed",
            "exit_code": None,
            "signal": "SIGTERM",
            "message": "stopped: rank 1 failed",
            "trace": "rank-0/trace.jsonl.gz",
            "ended_s": 4.0,
        },
        {
            "rank": 1,
            "status": "exception",
            "exit_code": 1,
            "signal": None,
            "message": "RuntimeError: planted failure",
            "trace": "rank-1/trace.jsonl.gz",
            "ended_s": 3.0,
        },
    ]
    data = {"world_size": world, "ranks": ranks, "failed_first": 1, "failed_first_why": WHY}
    (out / "ranks.json").write_text(json.dumps(data))
    return data


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two ranks' folders, profiled once; tests copy them (``out``)."""
    root = tmp_path_factory.mktemp("ranks") / "out"
    with memdoctor.profile(root / "rank-0", steps=3, warmup=1, collect="none"):
        _train(16, 6, 0.0)
    with pytest.raises(RuntimeError), memdoctor.profile(root / "rank-1", steps=3, warmup=1, collect="none"):
        _train(512, 6, 0.03, fail_at=3)
    _stamp(root / "rank-0" / "trace.jsonl.gz", 0, collectives=True)
    _stamp(root / "rank-1" / "trace.jsonl.gz", 1, collectives=False)
    return root


@pytest.fixture
def out(profiled: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    shutil.copytree(profiled, folder)
    return folder


def _rank_summary(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank-{rank}" / "summary.json").read_text())


def _embedded(html: str) -> dict[str, Any]:
    start = html.index('id="memdoctor-data">') + len('id="memdoctor-data">')
    return json.loads(html[start : html.index("</script>", start)])


# ------------------------------------------------------------------------------------------- merged


def test_merged_summary_compares_the_ranks(out: Path) -> None:
    _launch(out)
    write_merged(out)
    merged = json.loads((out / "summary.json").read_text())
    rank0, rank1 = _rank_summary(out, 0), _rank_summary(out, 1)
    assert merged["world_size"] == WORLD
    assert [r["rank"] for r in merged["ranks"]] == [0, 1]
    for row, own in zip(merged["ranks"], (rank0, rank1), strict=True):
        assert row["peak_memory_bytes"] == own["peak_memory_bytes"] is not None
        assert row["step_time_ms"] == own["step_time_ms"] is not None
        assert row["report"] == f"{row['folder']}/report.html"
        assert (out / row["report"]).is_file()
        assert row["problems"] == []
    assert [r["status"] for r in merged["ranks"]] == ["killed", "exception"]
    # rank 1: a 512-wide model against a 16-wide one, 30 ms of sleep a step against none
    assert rank1["peak_memory_bytes"] > rank0["peak_memory_bytes"]
    assert rank1["step_time_ms"] > rank0["step_time_ms"] + 20
    peak, step = merged["imbalance"]["peak_memory_bytes"], merged["imbalance"]["step_time_ms"]
    assert peak["max_rank"] == 1 and peak["min_rank"] == 0 and peak["balanced"] is False
    assert peak["max_over_min"] == round(rank1["peak_memory_bytes"] / rank0["peak_memory_bytes"], 3)
    assert step["max_over_min"] == round(rank1["step_time_ms"] / rank0["step_time_ms"], 3)
    assert merged["slowest_rank"] == 1 and merged["largest_peak_rank"] == 1
    assert merged["peak_memory_bytes"] == rank1["peak_memory_bytes"]
    assert merged["failed_first"] == 1 and merged["failed_first_why"] == WHY
    assert merged["status"] == "exception"
    assert merged["all_fit"] is True  # nobody ran out of memory; no budget to be over
    assert merged["headline"].startswith(
        "Rank 1 of 2 failed first (exception: RuntimeError: planted failure)"
    )


def test_collectives_are_measured_per_step_or_said_not_measured(out: Path) -> None:
    _launch(out)
    merged = merged_summary(out)
    trace = load_trace(out / "rank-0" / "trace.jsonl.gz")
    profiled = trace.profiled_steps()
    ms = [_collectives(trace.steps.index(s))["ms"] for s in profiled]
    comm = merged["ranks"][0]["collectives"]
    assert comm["source"] == "measured" and comm["steps"] == len(profiled) == 3
    assert comm["ms_per_step"] == round(statistics.median(ms), 3)
    assert comm["calls_per_step"] == 3 and comm["bytes_per_step"] == 4096
    shares = [m / s.duration_ms for m, s in zip(ms, profiled, strict=True)]
    assert comm["share_of_step"] == round(statistics.median(shares), 3)
    assert list(comm["by_op"]) == ["all_reduce", "<b>broadcast</b>"]  # most time first
    assert merged["ranks"][1]["collectives"] is None
    assert "not measured" in merged["ranks"][1]["collectives_note"]
    assert merged["collectives"]["measured_ranks"] == [0]
    assert merged["collectives"]["not_measured_ranks"] == [1]
    assert merged["collectives"]["largest_share_rank"] == 0


def test_html_answers_first_and_links_every_rank(out: Path) -> None:
    _launch(out)
    paths = write_merged(out)
    html = paths["report"].read_text()
    merged = json.loads(paths["summary"].read_text())
    assert _embedded(html) == merged
    for rank in (0, 1):
        assert f'href="rank-{rank}/report.html"' in html
    for question in ("Did every rank fit?", "Which rank is the worst?", "Is the load balanced?"):
        assert question in html
    assert "How much time goes to communication?" in html
    assert "Rank 1 failed first" in html
    for row in merged["ranks"]:
        assert format_bytes(row["peak_memory_bytes"]) in html
    ratio = merged["imbalance"]["step_time_ms"]["max_over_min"]
    assert f"&times;{ratio:.2f}" in html
    share = merged["ranks"][0]["collectives"]["share_of_step"]
    assert f"{100 * share:.0f}%</b> of a step on rank 0" in html
    assert "Not measured on rank 1" in html
    assert html.count('src="data:image/svg+xml;base64,') == 1  # the per-rank chart
    assert "peak (measured)" in html and "step time (measured)" in html
    assert "<b>broadcast</b>" not in html and "&lt;b&gt;broadcast&lt;/b&gt;" in html  # names escaped


# --------------------------------------------------------------------------------- what is missing


def test_without_ranks_json_ranks_come_from_their_traces(out: Path) -> None:
    merged = merged_summary(out)
    assert merged["world_size"] == WORLD  # the traces' distributed header
    assert [r["status"] for r in merged["ranks"]] == ["ok", "exception"]  # from each trace's end
    assert merged["failed_first"] == 1
    assert (
        merged["failed_first_why"].startswith("exception: ")
        and "planted failure" in merged["failed_first_why"]
    )
    assert any("no ranks.json" in p for p in merged["problems"])


def test_a_corrupt_rank_trace_is_named_and_the_rest_merged(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _launch(out)
    (out / "rank-1" / "trace.jsonl.gz").write_bytes(b"not gzip at all")
    (out / "rank-1" / "summary.json").unlink()
    assert main(["report", str(out)]) == exitcodes.OK
    merged = json.loads((out / "summary.json").read_text())
    row = merged["ranks"][1]
    assert row["status"] == "exception"  # ranks.json still says how it ended
    assert row["peak_memory_bytes"] is None and row["step_time_ms"] is None
    assert any("its trace cannot be read" in p for p in row["problems"])
    assert merged["ranks"][0]["peak_memory_bytes"] == _rank_summary(out, 0)["peak_memory_bytes"]
    assert merged["imbalance"]["peak_memory_bytes"] is None  # one rank's figure is no comparison
    html = (out / "report.html").read_text()
    assert "What could not be read" in html and "its trace cannot be read" in html
    err = capsys.readouterr().err
    assert "rank 1: its trace cannot be read" in err and "Traceback" not in err


def test_a_missing_summary_is_built_from_the_trace(out: Path) -> None:
    _launch(out)
    peak = _rank_summary(out, 0)["peak_memory_bytes"]
    (out / "rank-0" / "summary.json").unlink()
    merged = merged_summary(out)
    assert merged["ranks"][0]["peak_memory_bytes"] == peak
    assert any("built from its trace" in p for p in merged["ranks"][0]["problems"])
    assert not (out / "rank-0" / "summary.json").exists()  # the rank's folder is left as it was


def test_a_rank_with_no_folder_is_a_row_that_says_so(out: Path) -> None:
    _launch(out, world=3)
    merged = merged_summary(out)
    assert merged["world_size"] == 3 and len(merged["ranks"]) == 3
    assert merged["ranks"][2]["status"] == "unknown"
    assert merged["ranks"][2]["problems"] == ["nothing to read: no rank-2 folder"]
    assert merged["all_fit"] is None  # rank 2 left no figure
    html = write_merged(out)["report"].read_text()
    assert "rank 2 left no figure to tell" in html and "no report" in html


def test_a_cut_trace_is_read_up_to_its_last_record(out: Path) -> None:
    path = out / "rank-0" / "trace.jsonl.gz"
    trace = load_trace(path)
    trace.end = None  # a rank killed before its end record or its summary was written
    save_trace(trace, path)
    (out / "rank-0" / "summary.json").unlink()
    merged = merged_summary(out)
    row = merged["ranks"][0]
    assert row["status"] == "unknown" and row["peak_memory_bytes"] is not None
    assert any("cut short" in p for p in row["problems"])


def test_ranks_json_cannot_name_a_trace_outside_the_folder(out: Path) -> None:
    data = _launch(out)
    data["ranks"][0]["trace"] = "../../elsewhere/trace.jsonl.gz"
    (out / "ranks.json").write_text(json.dumps(data))
    row = merged_summary(out)["ranks"][0]
    assert row["folder"] == "rank-0" and row["peak_memory_bytes"] is not None
    assert any("outside" in p for p in row["problems"])


# ---------------------------------------------------------------------------------------- the command


def test_report_rerenders_beside_and_links_back(out: Path) -> None:
    _launch(out)
    assert main(["report", str(out)]) == exitcodes.OK
    assert (out / "report.html").is_file()
    assert main(["report", str(out)]) == exitcodes.OK  # a report is there: rerender-1, links up one folder
    html = (out / "rerender-1" / "report.html").read_text()
    assert 'href="../rank-0/report.html"' in html and 'href="../rank-1/report.html"' in html


def test_report_each_rank_rerenders_every_rank_it_can(out: Path) -> None:
    _launch(out)
    dest = out.parent / "again"
    assert main(["report", str(out), "--each-rank", "-o", str(dest)]) == exitcodes.OK
    for rank in (0, 1):
        assert (dest / f"rank-{rank}" / "report.html").is_file()
        assert json.loads((dest / f"rank-{rank}" / "summary.json").read_text())["peak_memory_bytes"] > 0
    html = (dest / "report.html").read_text()
    assert 'href="rank-0/report.html"' in html
    rank_page = (dest / "rank-1" / "report.html").read_text()
    assert "rank 1 of 2" in rank_page and 'href="../report.html"' in rank_page  # back to the merged one


def test_each_rank_does_not_overwrite_a_rank_without_force(out: Path) -> None:
    _launch(out)
    (out / "rank-0" / "report.html").write_text("mine")
    assert main(["report", str(out), "--each-rank"]) == exitcodes.USAGE_ERROR  # into OUT: rank-0 has one
    assert (out / "rank-0" / "report.html").read_text() == "mine"
    assert not (out / "report.html").exists()  # refused before anything was written
    assert main(["report", str(out), "--each-rank", "--force"]) == exitcodes.OK
    assert "memdoctor-data" in (out / "rank-0" / "report.html").read_text()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"world_size": "two", "ranks": []}),
        json.dumps({"world_size": 2, "ranks": [{"rank": 0}, {"rank": 0}]}),
        json.dumps({"world_size": 2, "ranks": [{"rank": 5}]}),
    ],
)
def test_a_bad_ranks_json_is_one_line_exit_2(
    out: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (out / "ranks.json").write_text(content)
    assert main(["report", str(out)]) == exitcodes.USAGE_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memdoctor: error: ") and "ranks.json" in err[0]
    assert not (out / "report.html").exists()


def test_each_rank_on_a_single_trace_is_a_usage_error(out: Path) -> None:
    assert main(["report", str(out / "rank-0"), "--each-rank"]) == exitcodes.USAGE_ERROR


def test_write_merged_on_a_folder_without_ranks_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a multi-rank profile folder"):
        write_merged(tmp_path)


# ------------------------------------------------------------------------------------------- units


def test_status_from_a_trace_end_in_the_launchers_words() -> None:
    assert analysis.status_from_end({"status": "completed"}) == "ok"
    assert analysis.status_from_end({"status": "script_exit", "exit_code": 0}) == "ok"
    assert analysis.status_from_end({"status": "script_exit", "exit_code": 3}) == "exception"
    assert analysis.status_from_end({"status": "crashed"}) == "killed"
    assert analysis.status_from_end({"status": "oom"}) == "oom"
    assert analysis.status_from_end(None) == "unknown"


def test_an_out_of_memory_rank_did_not_fit_and_failed_first_by_its_end_time() -> None:
    inputs = [
        analysis.RankInput(0, "rank-0", summary={"peak_memory_bytes": 100, "step_time_ms": 10.0}),
        analysis.RankInput(
            1, "rank-1", summary={"peak_memory_bytes": 300, "step_time_ms": 11.0}, end={"status": "oom"}
        ),
        analysis.RankInput(2, "rank-2", summary={"peak_memory_bytes": 200, "step_time_ms": 10.5}),
    ]
    inputs[0].end, inputs[0].ended_unix = {"status": "killed"}, 50.0
    inputs[1].ended_unix = 40.0
    merged = analysis.merged_summary(3, inputs, None, [])
    assert merged["all_fit"] is False and merged["ranks"][1]["fits"] is False
    assert merged["failed_first"] == 1 and merged["failed_first_why"] == "oom"
    assert merged["imbalance"]["peak_memory_bytes"]["max_over_min"] == 3.0
    assert merged["imbalance"]["step_time_ms"]["balanced"] is True  # 11 / 10 is within 10%


def test_a_peak_over_the_budget_did_not_fit() -> None:
    inp = analysis.RankInput(0, "rank-0", summary={"peak_memory_bytes": 300, "budget_bytes": 200})
    assert analysis.rank_row(inp)["fits"] is False


def test_collectives_on_the_step_record_itself_are_read() -> None:
    step = StepRecord(0, False, True, 10.0, {}, 1, {}, {}, {})
    step.collectives = {"ms": 2.0, "calls": 1, "bytes": 8}  # type: ignore[attr-defined]
    trace = Trace(header={}, steps=[step])
    comm = analysis.collectives_per_step(trace)
    assert comm is not None and comm["ms_per_step"] == 2.0 and comm["share_of_step"] == 0.2
    step.collectives = {"ms": -1}  # type: ignore[attr-defined]  # malformed: not measured
    assert analysis.collectives_per_step(trace) is None


def test_launch_record_keeps_an_absent_failed_first_apart_from_none() -> None:
    base = {"world_size": 1, "ranks": [{"rank": 0, "status": "ok"}]}
    assert "failed_first" not in analysis.launch_record(base)
    assert analysis.launch_record({**base, "failed_first": None})["failed_first"] is None


def test_check_on_a_merged_folder_guards_the_largest_rank(out: Path) -> None:
    _launch(out)
    write_merged(out)
    largest = _rank_summary(out, 1)["peak_memory_bytes"]
    assert main(["check", str(out), "--max-peak", str(largest)]) == exitcodes.OK
    assert main(["check", str(out), "--max-peak", str(largest - 1)]) == exitcodes.LIMIT_EXCEEDED


def test_a_rank_s_engine_buffers_are_rows_of_its_memory_table() -> None:
    """A DDP rank's gradient buckets (and an FSDP2 rank's buffers) are shown, before "other"; a
    one-process summary gets no such rows."""
    from memdoctor.report.render import category_rows

    cats = {"parameters": 10, "gradients": 10, "optimizer_state": 0, "activations": 5, "gradient_buckets": 10}
    rows = category_rows({"peak_memory_bytes": 40, "categories": {**cats, "other": 5}})
    keys = [r["key"] for r in rows]
    assert keys[-2:] == ["gradient_buckets", "other"] and rows[-2]["share"] == 0.25
    assert "DDP gradient buckets" in rows[-2]["label"]
    plain = category_rows({"peak_memory_bytes": 30, "categories": {"parameters": 30}})
    assert "gradient_buckets" not in [r["key"] for r in plain]
