"""Every limit the writer allows, the reader accepts; every file past the reader's caps is refused with
one line naming the cap, after reading no more than the cap (issue 19, point 4). Crafted files, in
process; the bombs at full size are measured by ``benchmarks/trace_bombs.py``."""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import statistics
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.analysis.numbers import median_of_others
from memdoctor.analysis.summary import EVENT_ROWS, summary_figures
from memdoctor.capture.discovery import describe_model
from memdoctor.cli import main
from memdoctor.config.file import parse_config
from memdoctor.errors import ConfigError, TraceError, UsageError
from memdoctor.levers.modnames import recorded_names, submodule
from memdoctor.report.render import render_report
from memdoctor.trace import (
    MAX_NAME_CHARS,
    TraceWriter,
    event_record,
    load_trace,
    make_end,
    save_trace,
    stream,
)
from memdoctor.trace import reader as trace_reader
from memdoctor.trace.records import MAX_MESSAGE_CHARS
from memdoctor.trace.stream import GzipLines
from memdoctor.units import fit_name, parse_size
from tests.tracebuilder import TraceBuilder, tiny_mlp

MiB = 1024**2


def _member(rec: dict[str, Any]) -> bytes:
    return gzip.compress(json.dumps(rec).encode() + b"\n", mtime=0)


def _records(path: Path) -> list[dict[str, Any]]:
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=2)
    b.end("completed", "profiled")
    b.save(path)
    return b.build().records()


def _write(path: Path, records: list[dict[str, Any]], tail: bytes = b"") -> Path:
    path.write_bytes(b"".join(_member(r) for r in records) + tail)
    return path


class CountingFile(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_bytes = 0

    def read(self, n: int | None = -1) -> bytes:
        out = super().read(n)
        self.read_bytes += len(out)
        return out


def test_a_file_that_is_not_gzip_is_refused_after_two_bytes() -> None:
    fh = CountingFile(b"\0" * (4 * MiB))
    with pytest.raises(TraceError, match="not a gzip file"):
        list(GzipLines(fh, "big.bin", max_bytes=MiB, max_line=MiB))
    assert fh.read_bytes == 2


def test_a_newline_bomb_is_refused_at_its_first_empty_line(tmp_path: Path) -> None:
    records = _records(tmp_path / "t.jsonl.gz")
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(comp.compress(b"\n" * MiB) for _ in range(8)) + comp.flush()
    path = _write(tmp_path / "bomb.jsonl.gz", records[:1], bomb)
    with pytest.raises(TraceError, match=r"record 2 is invalid \(an empty line\)"):
        load_trace(path)
    lines = GzipLines(path.open("rb"), "bomb", max_bytes=2**40, max_line=MiB)
    it = iter(lines)
    next(it), next(it)  # the header and the first empty line
    assert lines.decompressed <= 2 * MiB, "the reader decompressed far ahead of the line it returned"


def test_decompressed_bytes_past_the_cap_are_refused_naming_it() -> None:
    data = gzip.compress(b"x" * MiB + b"\n")
    with pytest.raises(TraceError, match="more than the cap of 100000 bytes"):
        list(GzipLines(io.BytesIO(data), "t", max_bytes=100_000, max_line=10 * MiB))


def test_a_line_past_the_cap_is_refused_before_it_is_buffered_whole() -> None:
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    data = b"".join(comp.compress(b" " * MiB) for _ in range(8)) + comp.flush()
    lines = GzipLines(io.BytesIO(data), "t", max_bytes=2**40, max_line=MiB)
    with pytest.raises(TraceError, match=f"record 1 is larger than the cap of {MiB} bytes"):
        list(lines)
    assert lines.decompressed <= 3 * MiB


def test_the_record_length_cap_reaches_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _records(tmp_path / "t.jsonl.gz")
    records[1]["class"] = "M" * 5000
    path = _write(tmp_path / "long.jsonl.gz", records)
    monkeypatch.setattr(trace_reader, "MAX_RECORD_CHARS", 4096)
    assert main(["report", str(path), "-o", str(tmp_path / "out")]) == 3


def test_members_are_read_in_linear_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zlib is handed each compressed byte a bounded number of times: about twice, plus at most one
    first window per member (the old reader handed it the whole rest of the file for each member:
    quadratic in the member count)."""
    records = _records(tmp_path / "t.jsonl.gz")
    tiny = _member({"type": "x"})
    path = _write(tmp_path / "many.jsonl.gz", records[:-1], tiny * 5_000 + _member(records[-1]))
    fed = [0]
    take = GzipLines._take

    def counted(self: GzipLines, n: int) -> Any:
        piece = take(self, n)
        fed[0] += len(piece)
        return piece

    monkeypatch.setattr(GzipLines, "_take", counted)
    trace = load_trace(path)
    assert len(trace.steps) == 3
    members = len(records) + 5_000
    assert fed[0] <= 2 * path.stat().st_size + stream.FIRST_WINDOW * members


def test_records_past_their_type_cap_are_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _records(tmp_path / "t.jsonl.gz")
    events = [{"type": "event", "kind": "note", "message": f"n{i}"} for i in range(6)]
    path = _write(tmp_path / "ev.jsonl.gz", [*records[:-1], *events, records[-1]])
    monkeypatch.setattr(trace_reader, "MAX_RECORDS", {**trace_reader.MAX_RECORDS, "event": 5, "other": 2})
    with pytest.raises(TraceError, match="more than the cap of 5 event records"):
        load_trace(path)
    unknown = [{"type": "future"} for _ in range(3)]
    path = _write(tmp_path / "other.jsonl.gz", [*records[:-1], *unknown, records[-1]])
    with pytest.raises(TraceError, match="more than the cap of 2 records of unknown types"):
        load_trace(path)


@pytest.mark.parametrize(
    ("where", "value", "why"),
    [
        ("step", 10**400, "a number of 401 digits"),
        ("step", 1e300, "a number past 1e+40"),
        ("header", 1e300, "a number past 1e+40"),
        ("header", 1e30, "created_unix has an invalid value"),
        ("step", float("nan"), "NaN is not a number a trace may hold"),
    ],
)
def test_overflowing_numbers_are_a_corrupt_trace_exit_3(
    tmp_path: Path, where: str, value: Any, why: str
) -> None:
    records = _records(tmp_path / "t.jsonl.gz")
    if where == "header":
        records[0]["created_unix"] = value
    else:
        records[3]["duration_ms"] = value
    path = tmp_path / "n.jsonl.gz"
    path.write_bytes(b"".join(gzip.compress(json.dumps(r).encode() + b"\n") for r in records))
    with pytest.raises(TraceError, match=re.escape(why)):
        load_trace(path)
    assert main(["report", str(path), "-o", str(tmp_path / "out")]) == 3


def test_figures_up_to_the_number_cap_still_load(tmp_path: Path) -> None:
    records = _records(tmp_path / "t.jsonl.gz")
    records[3]["memory"]["peak_bytes"] = 10**30
    trace = load_trace(_write(tmp_path / "big.jsonl.gz", records))
    assert trace.steps[1].memory["peak_bytes"] == 10**30


def test_absurd_sizes_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="larger than memdoctor takes"):
        parse_size("9" * 400 + "GB")
    with pytest.raises(UsageError, match="larger than memdoctor takes"):
        parse_size("2000000TiB")
    assert parse_size("8GiB") == 8 * 1024**3


# --------------------------------------------------------------------------------------- long names


def _long_named() -> nn.Module:
    """A model whose innermost module's qualified name is 6,001 characters long."""
    inner = nn.Module()
    inner.add_module("b" * 3000, nn.Linear(2, 2))
    outer = nn.Module()
    outer.add_module("a" * 3000, inner)
    return outer


def test_a_name_past_the_limit_is_cut_the_same_way_everywhere(tmp_path: Path) -> None:
    model = _long_named()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    info = describe_model(0, model, [opt]).info
    longest = max(info.names, key=len)
    assert len(longest) == MAX_NAME_CHARS and "~" in longest
    real = max((n for n, _ in model.named_modules()), key=len)
    assert fit_name(real) == longest and fit_name(real) == fit_name(real)
    assert fit_name(real + ".0") != fit_name(real)  # names sharing a start stay apart
    assert recorded_names(model) == info.names
    assert submodule(model, longest) is model.get_submodule(real)
    assert submodule(model, "a" * 3000) is model.get_submodule("a" * 3000)
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.end("completed", "profiled")
    trace = b.build()
    trace.models[0] = info
    path = save_trace(trace, tmp_path / "long.jsonl.gz")
    assert max(load_trace(path).models[0].names, key=len) == longest


def test_fit_name_keeps_short_names() -> None:
    assert fit_name("encoder.layer.3") == "encoder.layer.3"
    assert len(fit_name("x" * 10_000)) == MAX_NAME_CHARS


# ------------------------------------------------------------------------------- steps and events


def test_median_of_others_is_the_median_of_every_other_value() -> None:
    rng = random.Random(7)
    for _ in range(500):
        values = [rng.choice([1.0, 2.0, 5.0, rng.random()]) for _ in range(rng.randint(1, 9))]
        one = rng.choice(values)
        rest = list(values)
        rest.remove(one)
        expected = statistics.median(rest) if rest else None
        assert median_of_others(sorted(values), one) == expected


def test_events_past_the_row_cap_are_counted_not_listed(tmp_path: Path) -> None:
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=2)
    n = EVENT_ROWS + 250
    for i in range(n):
        b.add_event("note", f"note {i}")
    b.end("completed", "profiled")
    trace = b.build()
    summary = summary_figures(trace)
    assert len(summary["events"]) == EVENT_ROWS and summary["events_left_out"] == 250
    assert summary["events"][0]["message"] == "note 0"
    assert summary["events"][-1]["message"] == f"note {n - 1}"
    html = render_report(trace)
    assert 'id="events-left-out"' in html and "250 events" in html
    assert f"note {EVENT_ROWS // 2 + 10}" not in html.split('id="event-table"')[1].split("</table>")[0]


# ------------------------------------------------------------------------------------- exit codes


class ClosedPipe(io.StringIO):
    """A stdout whose reader has gone (``memdoctor report ... | head``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError

    def flush(self) -> None:
        raise BrokenPipeError


def test_a_closed_stdout_pipe_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl.gz"
    _records(path)
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["report", str(path), "-o", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("value", ["1" + "0" * 400, ".inf", ".nan", "-1"])
def test_an_overflowing_number_in_a_config_is_a_config_error(value: str) -> None:
    text = f"memdoctor_config: 1\nprovenance:\n  predicted_step_time_ratio: {value}\n"
    with pytest.raises(ConfigError, match="predicted_step_time_ratio must be a number from 0"):
        parse_config(text)
    assert parse_config(text.replace(value, "1.25")).provenance.predicted_step_time_ratio == 1.25


def test_a_huge_message_is_written_as_the_reader_keeps_it(tmp_path: Path) -> None:
    """A message the writer takes whole (a long ``ConfigError``) is cut as written, never making the
    trace unreadable (the reader's text limit is 64 KiB)."""
    path = tmp_path / "t.jsonl.gz"
    records = _records(path)
    writer = TraceWriter(path.with_name("m.jsonl.gz"))
    for rec in records[:-1]:
        writer.write(rec)
    writer.write(event_record("config_error", "x" * 200_000))
    end = make_end(status="config_error", message="y" * 200_000, steps_recorded=2, duration_s=1)
    writer.write({"type": "end", **end})
    writer.close()
    trace = load_trace(path.with_name("m.jsonl.gz"))
    assert trace.events[-1]["message"] == "x" * MAX_MESSAGE_CHARS
    assert trace.end is not None and len(trace.end["message"]) == MAX_MESSAGE_CHARS


def test_a_plan_naming_a_cut_module_applies_to_it() -> None:
    """The cut name a plan made from the trace holds finds its module in the live model (memdoctor.apply
    and memdoctor run share the lookup: memdoctor.levers.modnames)."""
    from memdoctor.levers.apply import apply

    model = _long_named()
    inner = max(recorded_names(model), key=len)
    config = parse_config(f"memdoctor_config: 1\ncheckpoint:\n- {inner}\n")
    target = submodule(model, inner)
    forward = target.forward
    applied = apply(config, model)
    try:
        assert target.forward is not forward, "the cut-named module was not checkpointed"
        model.get_submodule("a" * 3000).get_submodule("b" * 3000)(torch.randn(1, 2, requires_grad=True)).sum()
    finally:
        applied.remove()
    assert target.forward == forward


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("timeline", "module"), [0, -1]),  # a negative module index
        (("timeline", "depth"), [0, True]),  # a bool is no number
        (("timeline", "t_ms"), [0.5, -0.5]),  # (NaN and Inf are refused by the JSON decoder itself)
        (("timeline", "allocated"), [1, "2"]),
        (("timeline", "event"), ["fwd_pre", 3]),
        (("phases_ms", "forward"), -1.0),
        (("memory", "categories_at_peak"), {"activations": "1"}),
        (("memory", "peak_model"), -1),
    ],
    ids=["module", "depth", "t_ms", "figure", "event", "phase", "category", "peak_model"],
)
def test_column_checks_refuse_what_each_value_check_refused(
    tmp_path: Path, where: tuple[str, str], value: Any
) -> None:
    """The record checks run over a whole column at once (``trace.check._COLUMNS``): one bad value of a
    column still refuses the trace, naming the record."""
    records = _records(tmp_path / "t.jsonl.gz")
    step = next(r for r in records if r["type"] == "step")
    section, key = where
    if section == "timeline":
        n = len(step["timeline"]["t_ms"])
        value = value + [value[0]] * (n - len(value))  # the other columns' length
    step[section][key] = value
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"".join(gzip.compress(json.dumps(r).encode() + b"\n", mtime=0) for r in records))
    with pytest.raises(TraceError, match=r"record \d+ is invalid \(step"):
        load_trace(path)


def test_a_frozen_trace_answers_once_and_an_unfrozen_one_afresh(tmp_path: Path) -> None:
    from memdoctor.analysis.steps import peak_step

    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=3)
    trace = b.build()
    first = peak_step(trace)
    assert first is not None
    with trace.frozen():
        assert peak_step(trace) is first
        trace.steps.remove(first)  # not done while frozen: the answer stays the one found first
        assert peak_step(trace) is first
        profiled = trace.profiled_steps()
        profiled.clear()  # a caller's own list: the remembered one is untouched
        assert trace.profiled_steps()
    assert peak_step(trace) is not first  # outside, asked afresh
