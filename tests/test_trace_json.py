"""The trace reader parses records with orjson where it is installed (a dependency) and with the standard
library otherwise: both give the same records, and refuse the same lines (NaN and Infinity, numbers past
the cap, a line that is not an object, bad UTF-8) with the standard decoder's own words."""

from __future__ import annotations

from pathlib import Path

import pytest

from memdoctor.trace import load_trace
from memdoctor.trace import reader as trace_reader

DATA = Path(__file__).resolve().parent / "data"
LINES = [
    b'{"type": "step", "step": 3, "x": [1.5, -2, null, true, "\\u00e9"], "nested": {"a": [{}]}}',
    b'{"type":"step","step":1}   ',
    b'{"n": 123456789012345678901234567890}',  # past 64 bits: orjson refuses, the standard one reads it
]
REFUSED = [b'{"x": NaN}', b'{"x": Infinity}', b"[1, 2]", b'{"x": 1e999}', b'{"x": 1' + b"0" * 60 + b"}", b"{"]


def _both(monkeypatch: pytest.MonkeyPatch, line: bytes) -> tuple[object, object]:
    fast = _parse(line)
    monkeypatch.setattr(trace_reader, "_orjson", None)
    slow = _parse(line)
    monkeypatch.undo()
    return fast, slow


def _parse(line: bytes) -> object:
    try:
        return trace_reader._json(line)
    except ValueError as exc:
        return ("refused", type(exc).__name__, str(exc))


def test_orjson_is_the_parser_here() -> None:
    assert trace_reader._orjson is not None, "orjson is a dependency (pyproject)"


@pytest.mark.parametrize("line", LINES + REFUSED)
def test_both_parsers_agree_record_by_record(monkeypatch: pytest.MonkeyPatch, line: bytes) -> None:
    fast, slow = _both(monkeypatch, line)
    assert fast == slow
    assert isinstance(fast, dict) == (line in LINES)


def test_both_parsers_read_a_recorded_trace_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    path = DATA / "gpu-bert-base-b32-s512-8gib-reprofiled.jsonl.gz"
    fast = load_trace(path)
    monkeypatch.setattr(trace_reader, "_orjson", None)
    slow = load_trace(path)
    assert fast.header == slow.header and fast.collected == slow.collected
    assert [s.step for s in fast.steps] == [s.step for s in slow.steps]
    assert [s.modules for s in fast.steps] == [s.modules for s in slow.steps]
    assert [s.timeline for s in fast.steps] == [s.timeline for s in slow.steps]
