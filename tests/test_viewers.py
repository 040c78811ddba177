"""The memory timeline in other viewers' formats (issue 16): a Chrome/Perfetto trace-event JSON checked
against the format's rules, and a PyTorch memory snapshot run through torch's own ``_memory_viz`` (on a
CPU torch) and replayed as the memory_viz page does. Perfetto's own reader (the ``perfetto`` package's
TraceProcessor) downloads its binary at first use, so it cannot run offline: the schema is checked here.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from torch.cuda import _memory_viz

from memdoctor.analysis.runtimeline import run_timeline
from memdoctor.cli import main
from memdoctor.trace import Trace, load_trace
from memdoctor.viewers import memory_snapshot, memory_snapshot_pickle, perfetto_json

DATA = Path(__file__).parent / "data"
TRACES = [
    DATA / "cpu-tiny-bert-plain-loop-b4.jsonl.gz",
    DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz",
    DATA / "gpu-llama-1b-b4-s1024-8gib-oom.jsonl.gz",
    DATA / "gpu-mini-gpt-124m-b12-s1024-8gib-verified.jsonl.gz",
]
ACCOUNTED = ("parameters", "gradients", "optimizer_state", "activations")
# Trace Event Format: the fields each phase used here must carry.
REQUIRED = {
    "X": {"name", "ts", "dur", "pid", "tid"},
    "C": {"name", "ts", "pid", "args"},
    "M": {"name", "pid", "args"},
    "i": {"name", "ts", "pid", "s"},
}


@pytest.fixture(scope="module", params=TRACES, ids=lambda p: p.name.split(".")[0])
def trace(request: pytest.FixtureRequest) -> Trace:
    return load_trace(request.param)


def _strict(text: str) -> dict[str, Any]:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    data = json.loads(text, parse_constant=refuse)
    assert isinstance(data, dict)
    return data


def check_trace_events(data: dict[str, Any]) -> None:
    """The JSON object form of the Trace Event Format as Perfetto's importer reads it: each event's
    phase and required fields, numeric times and counter values, and complete events that nest on
    their thread (a slice that overlaps another one partly is dropped by the importer)."""
    assert data.get("displayTimeUnit") in ("ms", "ns")
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for ev in data["traceEvents"]:
        assert ev["ph"] in REQUIRED, ev
        assert REQUIRED[ev["ph"]] <= set(ev), ev
        assert isinstance(ev["pid"], int) and isinstance(ev.get("tid", 0), int)
        if ev["ph"] != "M":
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ev["ph"] == "C":
            assert ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values()), ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name", "thread_sort_index"), ev
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
            by_thread.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for slices in by_thread.values():
        stack: list[float] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, "slices overlap without nesting"
            stack.append(end)


def test_perfetto_json_follows_the_trace_event_format(trace: Trace) -> None:
    data = _strict(perfetto_json(trace))
    check_trace_events(data)
    events = data["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(steps) == len(trace.steps)
    for ev, step in zip(steps, trace.steps, strict=True):
        if step.duration_ms is not None:
            assert ev["dur"] == pytest.approx(step.duration_ms * 1000, abs=0.01)
    cols = run_timeline(trace)
    memory = [e for e in events if e["ph"] == "C" and e["name"] == "memory (tensor accounting)"]
    assert len(memory) == len(cols["time_ms"])
    peak = max(sum(e["args"].values()) for e in memory)
    assert peak == max(sum(int(cols[c][i] or 0) for c in ACCOUNTED) for i in range(len(cols["time_ms"])))
    allocated = [e["args"]["allocated"] for e in events if e["ph"] == "C" and "allocated" in e["args"]]
    assert allocated == [v for v in cols["allocated"] if v is not None]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"steps", "phases"} <= names and any(n.startswith("forward, depth ") for n in names)


def replay(snapshot: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """What memory_viz's Active Memory Timeline does with the device trace: each ``alloc`` opens a block
    at its address, each ``free_completed`` closes the one there; returns the blocks live at the end and
    the total after every event. Fails on a free of nothing or an address handed out twice."""
    live: dict[int, dict[str, Any]] = {}
    totals, total = [], 0
    for ev in snapshot["device_traces"][-1]:
        if ev["action"] == "alloc":
            assert ev["addr"] not in live and ev["size"] > 0
            live[ev["addr"]] = ev
            total += ev["size"]
        elif ev["action"] == "free_completed":
            assert live.pop(ev["addr"])["size"] == ev["size"]
            total -= ev["size"]
        totals.append(total)
    return live, totals


def test_memory_snapshot_replays_to_the_trace(trace: Trace) -> None:
    snapshot = pickle.loads(memory_snapshot_pickle(trace))
    live, totals = replay(snapshot)
    last = {c: trace.steps[-1].timeline[c][-1] for c in ACCOUNTED}
    by_category: dict[str, int] = {}
    for ev in live.values():
        by_category[ev["category"]] = by_category.get(ev["category"], 0) + ev["size"]
    assert {c: by_category.get(c, 0) for c in ACCOUNTED} == last
    cols = run_timeline(trace)
    accounted_peak = max(sum(int(cols[c][i] or 0) for c in ACCOUNTED) for i in range(len(cols["time_ms"])))
    assert max(totals) >= accounted_peak  # shrinks go first: no made-up peak between two samples
    if trace.device.get("kind") == "cuda":  # "other" fills the allocator's figure where it was read
        assert max(totals) >= max(v for v in cols["allocated"] if v is not None)
    else:
        assert max(totals) == accounted_peak and "other" not in by_category
    (segment,) = snapshot["segments"]
    active = {b["address"] for b in segment["blocks"] if b["state"] == "active_allocated"}
    assert active == set(live)
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]


def test_torch_memory_viz_reads_the_snapshot(trace: Trace) -> None:
    snapshot = memory_snapshot(trace)
    text = _memory_viz.trace(snapshot)
    assert f"{len(snapshot['device_traces'][-1])} entries" in text
    assert "segments: 1" in _memory_viz.segsum(snapshot)
    flame = _memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)  # no flamegraph.pl download
    assert "active_allocated" in flame
    assert _memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)
    assert "snapshot.pickle" in _memory_viz.trace_plot(snapshot)
    assert "snapshot.pickle" in _memory_viz.segment_plot(snapshot)


def test_timeline_command_writes_each_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["timeline", str(TRACES[0]), "-o", str(out)]) == 0
    check_trace_events(_strict(out.read_text()))
    assert main(["timeline", str(TRACES[1]), "--format", "memory-viz", "-o", str(tmp_path / "s.pickle")]) == 0
    assert pickle.loads((tmp_path / "s.pickle").read_bytes())["device_traces"]
    assert f"Wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["MISSING"], 3, "no such trace file"),
        (["README"], 3, "not a gzip file"),
        (["TRACE", "-o", "EXISTS"], 2, "exists; give --force"),
        (["TRACE", "-o", "DIR"], 2, "is a folder"),
        (["TRACE", "-o", "NODIR/x.json"], 2, "no such folder"),
    ],
)
def test_timeline_command_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, says: str
) -> None:
    (tmp_path / "EXISTS").write_text("mine")
    (tmp_path / "README").write_text("not a trace")
    (tmp_path / "DIR").mkdir()
    paths = {"TRACE": str(TRACES[0]), "MISSING": str(tmp_path / "missing.jsonl.gz")}
    argv = [
        "timeline",
        *(paths.get(a) or (str(tmp_path / a) if a.isupper() or "/" in a else a) for a in args),
    ]
    if "-o" not in args:
        argv += ["-o", str(tmp_path / "out.json")]
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert (tmp_path / "EXISTS").read_text() == "mine"


def test_timeline_command_overwrites_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    out.write_text("old")
    assert main(["timeline", str(TRACES[0]), "-o", str(out), "--force"]) == 0
    assert _strict(out.read_text())["traceEvents"]
