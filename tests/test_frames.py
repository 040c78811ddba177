"""``memdoctor.load``: a recorded trace's ledger, steps, timeline and findings as pandas DataFrames, with
the figures summary.json has (issue 16), on a CPU trace and recorded GPU ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

import memdoctor
from memdoctor.errors import TraceError, UsageError

DATA = Path(__file__).parent / "data"
CPU = DATA / "cpu-tiny-bert-plain-loop-b4.jsonl.gz"  # memdoctor profile examples/plain_loop.py on a CPU
GPU = DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz"  # timing steps between full ones, allocator figures
GPU_OOM = DATA / "gpu-llama-1b-b4-s1024-8gib-oom.jsonl.gz"  # one step, cut short by the OOM
BYTES = ("parameters", "gradients", "optimizer_state", "activations")


@pytest.fixture(scope="module", params=[CPU, GPU, GPU_OOM], ids=lambda p: p.name.split("-8gib")[0])
def run(request: pytest.FixtureRequest) -> memdoctor.frames.TraceFrames:
    return memdoctor.load(request.param)


def test_ledger_is_the_summary_layer_table(run: memdoctor.frames.TraceFrames) -> None:
    ledger, summary = run.ledger, run.summary
    assert isinstance(ledger, pd.DataFrame)
    assert len(ledger) == sum(len(m.names) for m in run.trace.models) == len(summary["layers"])
    assert set(ledger["step"]) == {summary["peak_step"]}
    assert list(ledger["name"]) == [row["name"] for row in summary["layers"]]
    for column, key in [("parameters", "param_bytes"), ("activations", "activation_bytes")]:
        expected = [row[key] for row in summary["layers"]]
        assert [None if pd.isna(v) else int(v) for v in ledger[column]] == expected
    assert all(str(ledger[c].dtype) == "Int64" for c in BYTES)  # "not measured" stays <NA>, apart from 0
    roots = ledger[ledger["depth"] == 0]
    assert int(roots["parameters_inclusive"].sum()) == int(ledger["parameters"].sum())


def test_steps_match_the_summary_and_one_clock(run: memdoctor.frames.TraceFrames) -> None:
    steps = run.steps
    assert list(steps["step"]) == [s["step"] for s in run.summary["steps"]]
    assert list(steps["peak_bytes"]) == [s["peak_bytes"] for s in run.summary["steps"]]
    starts, durations = list(steps["start_ms"]), list(steps["duration_ms"])
    for k in range(1, len(steps)):
        assert starts[k] == pytest.approx(starts[k - 1] + durations[k - 1])


def test_timeline_holds_every_sample(run: memdoctor.frames.TraceFrames) -> None:
    timeline = run.timeline
    assert len(timeline) == sum(len(s.timeline.get("t_ms") or []) for s in run.trace.steps)
    assert timeline["time_ms"].is_monotonic_increasing
    last = run.trace.steps[-1]
    tail = timeline[timeline["step"] == last.step].iloc[-1]
    assert [int(tail[c]) for c in BYTES] == [int(last.timeline[c][-1]) for c in BYTES]


def test_findings_are_the_plans(run: memdoctor.frames.TraceFrames) -> None:
    assert list(run.findings["rule"]) == [f["rule"] for f in run.summary["findings"]]
    assert {"rule", "severity", "title", "evidence"} <= set(run.findings.columns)


def test_cpu_trace_measures_no_allocator_and_finds() -> None:
    run = memdoctor.load(CPU)
    assert run.trace.device["kind"] == "cpu"
    assert run.timeline["allocated"].isna().all()
    assert run.timeline["activations"].notna().all()
    assert len(run.findings) > 0  # a 64 MiB budget leaves advice to give
    peak = run.steps.loc[run.steps["peak_bytes"].idxmax()]
    assert int(peak["peak_bytes"]) == run.summary["peak_memory_bytes"]


def test_gpu_trace_reads_the_allocator_and_the_timing_steps() -> None:
    run = memdoctor.load(GPU)
    assert run.timeline["allocated"].notna().any()
    timing = run.steps[run.steps["detail"] == "timing"]
    assert len(timing) == 3 and timing["activations"].isna().all()
    assert int(run.ledger_at(5)["step"].iloc[0]) == 5
    with pytest.raises(UsageError, match="step 2 is a timing step"):
        run.ledger_at(2)
    with pytest.raises(UsageError, match="no step 99"):
        run.ledger_at(99)


def test_load_takes_the_folder_and_refuses_a_bad_file(tmp_path: Path) -> None:
    shutil.copy(CPU, tmp_path / "trace.jsonl.gz")
    assert len(memdoctor.load(tmp_path).steps) == 4
    (tmp_path / "bad.jsonl.gz").write_text("not a trace")
    with pytest.raises(TraceError, match=r"bad\.jsonl\.gz"):
        memdoctor.load(tmp_path / "bad.jsonl.gz")
    assert memdoctor.load(GPU).events["kind"].tolist() == ["stopped"]
