"""Fuzzing the trace loader: every input either loads or raises memdoctor's own TraceError, and every
trace that loads can be summarised (a crafted or damaged trace must not crash memdoctor)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memdoctor.errors import TraceError
from memdoctor.report import build_summary
from memdoctor.trace import FORMAT_NAME, load_trace

pytestmark = pytest.mark.fuzz

HEADER = {"type": "header", "format": FORMAT_NAME, "format_version": 1}
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
KEYS = [
    "type",
    "model",
    "class",
    "modules",
    "name",
    "type",
    "parent",
    "param_bytes",
    "param_count",
    "trainable_param_bytes",
    "step",
    "warmup",
    "complete",
    "duration_ms",
    "phases_ms",
    "memory",
    "timeline",
    "peak_bytes",
    "kind",
    "message",
    "status",
]
record = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8).map(
    lambda d: {**d, "type": d.get("type") if d.get("type") in ("model", "step", "event", "end") else "step"}
)


def _write(tmp: Path, records: list[object]) -> Path:
    path = tmp / "t.jsonl.gz"
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes(gzip.compress(text.encode()))
    return path


def _load_or_refuse(path: Path) -> None:
    try:
        trace = load_trace(path)
    except TraceError:
        return
    build_summary(trace)


FUZZ = settings(
    max_examples=750,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(records=st.lists(record, max_size=5))
def test_structured_records_load_or_are_refused(tmp_path: Path, records: list[dict]) -> None:
    _load_or_refuse(_write(tmp_path, [HEADER, *records]))


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_cleanly(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(TraceError):
        load_trace(path)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(cut=st.integers(min_value=1, max_value=10_000))
def test_truncated_real_trace_is_refused(tmp_path: Path, cut: int) -> None:
    real = (Path(__file__).parent / "data" / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz").read_bytes()
    cut = cut % len(real)
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(real[: max(1, cut)])
    with pytest.raises(TraceError):
        load_trace(path)
    try:  # what a crashed run's supervisor does: keep the whole records, flag the cut
        salvaged = load_trace(path, salvage=True)
    except TraceError:
        return  # not even the header survived
    assert salvaged.truncated or salvaged.end is None  # a cut mid-record, or at a record boundary


def test_absurd_values_are_refused(tmp_path: Path) -> None:
    model = {
        "type": "model",
        "model": 0,
        "class": "M",
        "modules": {
            "name": [""],
            "type": ["M"],
            "parent": [-1],
            "param_bytes": [-5],
            "param_count": [1],
            "trainable_param_bytes": [0],
        },
    }
    with pytest.raises(TraceError, match="invalid"):
        load_trace(_write(tmp_path, [HEADER, model]))
    long_name = dict(model, modules=dict(model["modules"], name=["x" * 100_000], param_bytes=[1]))
    with pytest.raises(TraceError):
        load_trace(_write(tmp_path, [HEADER, long_name]))


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON value (lists by index, at most the first 3 items)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: object, path: tuple, value: object) -> None:
    for key in path[:-1]:
        obj = obj[key]  # type: ignore[index]
    obj[path[-1]] = value  # type: ignore[index]


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_valid_trace_loads_summarises_and_renders_or_is_refused(tmp_path: Path, data) -> None:
    from memdoctor.report import render_report
    from tests.tracebuilder import oom_trace

    records = oom_trace(2).records()
    i = data.draw(st.integers(0, len(records) - 1))
    paths = [p for p in _paths(records[i]) if p and p[0] != "type"]
    if paths:
        _set(records[i], data.draw(st.sampled_from(paths)), data.draw(json_values))
    path = _write(tmp_path, records)
    try:
        trace = load_trace(path)
    except TraceError:
        return
    render_report(trace)


def test_trace_cut_at_a_record_boundary_is_refused_but_salvageable(tmp_path: Path) -> None:
    """Records are whole gzip members: only the missing end record shows such a cut."""
    path = _write(tmp_path, [HEADER])
    with pytest.raises(TraceError, match="no end record"):
        load_trace(path)
    assert load_trace(path, salvage=True).end is None
