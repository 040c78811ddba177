"""The collector framework: what a collector is called with, where its data lands in the trace, and
that a failing collector is switched off without failing the script."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.capture.collectors import NAMES as REGISTRY
from memdoctor.capture.collectors import Collector, collector_classes, make_collectors, parse_names
from memdoctor.capture.session import ProfileSession
from memdoctor.cli import main
from memdoctor.device import FakeDevice
from memdoctor.trace import StepRecord, Trace, load_trace


class Recorder(Collector):
    name = "recorder"
    wants_modules = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.session: ProfileSession | None = None
        self.stopped = 0

    def start(self, session: ProfileSession) -> None:
        self.session = session
        session.emit(self.name, {"started": True})

    def stop(self) -> None:
        self.stopped += 1

    def on_step_start(self, step: int, detailed: bool) -> None:
        self.calls.append(("step", step, detailed))

    def on_forward_pre(self, key: int, module: nn.Module, depth: int, timed: bool) -> None:
        assert self.session is not None
        self.calls.append(("fwd_pre", type(module).__name__, depth, self.session.current_step()))

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        self.calls.append(("fwd_post", type(module).__name__, tuple(output.shape)))

    def on_backward(self, event: str, key: int, depth: int, grad: Any) -> None:
        self.calls.append((event, depth, None if grad is None else tuple(grad.shape)))

    def on_optimizer(self, step: int) -> None:
        self.calls.append(("opt", step))

    def on_optimizer_end(self, step: int) -> None:
        self.calls.append(("opt_end", step))

    def on_model(self, model: int, root: nn.Module) -> None:
        self.calls.append(("model", model, type(root).__name__))

    def step_field(self, step: int) -> Any:
        return {"step_seen": step}

    def module_columns(self, step: int) -> dict[int, dict[str, list[Any]]]:
        assert self.session is not None
        return {0: {"recorder_col": [float(step)] * self.session.module_count(0)}}


def _train(session: ProfileSession, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with session:
        for _ in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    return model


def test_collector_hooks_and_where_its_data_lands() -> None:
    records: list[dict] = []
    rec = Recorder()
    session = ProfileSession(steps=2, warmup=1, sink=records.append, collectors=[rec])
    _train(session, 5)
    assert rec.stopped >= 1
    assert [c for c in rec.calls if c[0] in ("step", "opt", "opt_end", "model")][:7] == [
        ("step", 0, True),
        ("model", 0, "Sequential"),
        ("opt", 0),
        ("opt_end", 0),
        ("step", 1, True),
        ("opt", 1),
        ("opt_end", 1),
    ]
    fwd = [c for c in rec.calls if c[0] == "fwd_pre"]
    assert [c[1] for c in fwd[:4]] == ["Sequential", "Linear", "ReLU", "Linear"]
    assert [c[2] for c in fwd[:4]] == [0, 1, 1, 1]
    assert ("fwd_post", "Linear", (4, 2)) in rec.calls
    # backward of the root: gradient of its output (4, 2) first
    assert ("bwd_pre", 0, (4, 2)) in rec.calls
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all(r["collectors"]["recorder"] == {"step_seen": r["step"]} for r in steps)
    assert all(r["modules"]["0"]["recorder_col"] == [float(r["step"])] * 4 for r in steps)
    assert {"type": "collector", "name": "recorder", "data": {"started": True}} in records
    # the step record reads back with its collector data
    assert StepRecord.from_record(steps[-1]).collectors == {"recorder": {"step_seen": steps[-1]["step"]}}


class Broken(Collector):
    name = "broken"
    wants_modules = True

    def __init__(self) -> None:
        self.stopped = False

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        raise RuntimeError("boom")

    def stop(self) -> None:
        self.stopped = True


def test_a_failing_collector_is_switched_off_and_the_script_runs_on() -> None:
    records: list[dict] = []
    broken = Broken()
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[broken, Recorder()])
    _train(session, 4)
    assert broken.stopped
    failed = [r for r in records if r.get("kind") == "collector_failed"]
    assert len(failed) == 1 and "broken" in failed[0]["message"] and "boom" in failed[0]["message"]
    assert len([r for r in records if r["type"] == "step"]) >= 2


def test_timing_steps_get_no_module_calls() -> None:
    rec = Recorder()
    session = ProfileSession(steps=4, warmup=1, device=FakeDevice(), collectors=[rec])
    _train(session, 8)
    starts = [c for c in rec.calls if c[0] == "step"]
    assert [(c[1], c[2]) for c in starts[:5]] == [(0, True), (1, True), (2, False), (3, False), (4, True)]
    fwd_steps = {c[3] for c in rec.calls if c[0] == "fwd_pre"}
    assert fwd_steps == {0, 1, 4}


def test_parse_names() -> None:
    assert parse_names("all") == list(REGISTRY)
    assert parse_names("none") == []
    first, second = list(REGISTRY)[:2]
    assert parse_names(f"{second},{first}") == [first, second]
    with pytest.raises(ValueError, match="unknown collector 'nope'"):
        parse_names("nope")


def test_unknown_collector_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    assert main(["profile", "--collect", "bogus", str(script)]) == 2
    err = capsys.readouterr().err
    assert "unknown collector 'bogus'" in err and "Traceback" not in err


def test_collector_record_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    header = {"type": "header", "format": "memdoctor-trace", "format_version": 1}
    recs = [header, {"type": "collector", "name": "x", "data": {"a": 1}}]
    recs += [{"type": "collector", "name": "x", "data": {"a": 2}}, {"type": "end", "status": "completed"}]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in recs) + "\n")
    trace: Trace = load_trace(path)
    assert trace.collected == {"x": {"a": 2}}
    assert {"type": "collector", "name": "x", "data": {"a": 2}} in trace.records()


def test_missing_collector_modules_are_noted() -> None:
    made, notes = make_collectors(list(REGISTRY), device=FakeDevice())
    names = {c.name for c in made}
    for n in REGISTRY:
        assert n in names or any(note.startswith(f"{n}:") for note in notes)


def test_the_names_are_the_collector_classes_own() -> None:
    assert tuple(collector_classes()) == REGISTRY


def test_collector_note_finds_the_reason_by_name() -> None:
    from memdoctor.analysis.notes import collector_note

    notes = ["GPU kernel times: no CUDA device", "transfers: no CUDA device: no copies", "nvtx: missing"]
    assert collector_note(notes, "transfers") == "no CUDA device: no copies"
    assert collector_note(notes, "nvtx") == "missing"
    assert collector_note(notes, "flops") is None and collector_note(None, "flops") is None
