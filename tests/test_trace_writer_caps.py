"""Every limit the reader enforces, the writer keeps (issue 19, point 4): a trace the writer writes is
always one the reader accepts. The caps are made small here so that crafted records cross them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memdoctor.trace import TraceWriter, event_record, load_trace, make_end
from memdoctor.trace import reader as trace_reader
from memdoctor.trace import writer as trace_writer
from memdoctor.trace.records import MAX_RECORDS
from tests.tracebuilder import TraceBuilder, bert_like, tiny_mlp


def _caps(monkeypatch: pytest.MonkeyPatch, *, line: int | None = None, total: int | None = None) -> None:
    """The same smaller cap for the writer and the reader."""
    for mod in (trace_writer, trace_reader):
        if line is not None:
            monkeypatch.setattr(mod, "MAX_RECORD_CHARS", line)
        if total is not None:
            monkeypatch.setattr(mod, "MAX_DECOMPRESSED_BYTES", total)


def _run(layers: int = 2) -> list[dict[str, Any]]:
    b = TraceBuilder(kind="cpu")
    b.add_model(bert_like(layers))
    b.add_steps(warmup=0, profiled=2)
    b.end("completed", "profiled")
    return b.build().records()


def _write(path: Path, records: list[dict[str, Any]]) -> TraceWriter:
    writer = TraceWriter(path)
    for rec in records:
        writer.write(rec)
    writer.close()
    return writer


def _sizes(records: list[dict[str, Any]]) -> dict[str, int]:
    return {r["type"]: len(trace_writer._dumps(r)) for r in records}


def test_a_step_record_over_the_line_cap_is_thinned_until_the_reader_accepts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _run()
    step = next(r for r in records if r["type"] == "step")
    samples = len(step["timeline"]["t_ms"])
    no_timeline = len(trace_writer._dumps({**step, "timeline": {}}))
    _caps(monkeypatch, line=no_timeline + (_sizes([step])["step"] - no_timeline) // 3)
    with pytest.raises(trace_reader.TraceError, match="larger than the cap"):  # unthinned: refused
        path = tmp_path / "raw.jsonl.gz"
        path.write_bytes(
            b"".join(trace_writer.gzip.compress(trace_writer._dumps(r) + b"\n") for r in records)
        )
        load_trace(path)
    trace = load_trace(_write(tmp_path / "t.jsonl.gz", records).path)
    written = trace.steps[0]
    assert written.timeline_stride >= 4 and written.detail == "full"
    assert 0 < len(written.timeline["t_ms"] or []) <= samples // 4 + 1
    assert written.modules == {int(k): v for k, v in step["modules"].items()}  # the ledger is kept


def test_a_step_whose_module_columns_alone_are_over_the_cap_becomes_a_timing_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [r for r in _run() if r["type"] != "model"]  # a model record here is larger than a step's
    step = next(r for r in records if r["type"] == "step")
    _caps(monkeypatch, line=len(trace_writer._dumps({**step, "timeline": {}, "modules": {}})) + 200)
    assert len(trace_writer._dumps({**step, "timeline": {}})) > trace_writer.MAX_RECORD_CHARS
    trace = load_trace(_write(tmp_path / "t.jsonl.gz", records).path)
    assert [s.detail for s in trace.steps] == ["timing", "timing"]
    assert trace.steps[0].modules == {} and trace.steps[0].duration_ms == step["duration_ms"]
    assert trace.steps[0].memory["peak_bytes"] == step["memory"]["peak_bytes"]


def test_a_model_record_over_the_line_cap_is_refused_naming_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _run()
    model = next(r for r in records if r["type"] == "model")
    _caps(monkeypatch, line=_sizes([model])["model"] - 1)
    writer = TraceWriter(tmp_path / "t.jsonl.gz")
    with pytest.raises(ValueError, match=f"cap of {trace_writer.MAX_RECORD_CHARS} bytes"):
        writer.write(model)
    writer.close()


def test_records_past_their_type_cap_are_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(MAX_RECORDS, "event", 5)
    records = _run()
    events = [event_record("note", f"event {i}") for i in range(8)]
    writer = _write(tmp_path / "t.jsonl.gz", records[:-1] + events + records[-1:])
    assert writer.dropped == {"event": 3}
    trace = load_trace(writer.path)
    assert [e["message"] for e in trace.events] == [f"event {i}" for i in range(5)]
    assert trace.end is not None and trace.end["status"] == "completed"


def test_a_trace_at_the_byte_cap_drops_records_but_keeps_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=30)
    records = b.build().records()
    sizes = [len(trace_writer._dumps(r)) + 1 for r in records]
    monkeypatch.setattr(trace_writer, "END_RESERVE", 2_000)
    _caps(monkeypatch, total=sum(sizes[:12]) + 2_000)
    end = dict(make_end(status="completed", message="done", steps_recorded=30, duration_s=1.0), type="end")
    writer = _write(tmp_path / "t.jsonl.gz", [*records, end])
    assert writer.dropped.get("step", 0) >= 18
    trace = load_trace(writer.path)  # within the cap, with its end: no salvage needed
    assert trace.end is not None and trace.end["status"] == "completed"
    assert 0 < len(trace.steps) <= 12
