"""Reading a trace back: concatenated gzip members, one JSON record a line, checked as they are read.

The writer flushes every record as its own gzip member, so a process that dies between records leaves
every earlier record readable; a cut or corrupt tail is refused, or dropped with ``salvage=True``. A
trace from a newer format version is refused with a ``TraceError`` naming the file, as is one whose
records fail their checks (``memdoctor.trace.check``).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memdoctor.errors import MemdoctorError, TraceError
from memdoctor.trace import check as tracecheck
from memdoctor.trace.records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_ABS_NUMBER,
    MAX_DECOMPRESSED_BYTES,
    MAX_RECORD_CHARS,
    MAX_RECORDS,
    ModelInfo,
    StepRecord,
    Trace,
    collector_from_record,
    event_from_record,
)
from memdoctor.trace.stream import GzipLines


def read_trace(path: str | os.PathLike[str] | None) -> Trace | None:
    """The trace at ``path``; None when there is none or it cannot be read (for callers that say so
    their own way: a run's summary table, a verify or re-profile round's record)."""
    try:
        return load_trace(path) if path is not None else None
    except MemdoctorError:
        return None


def load_trace(path: str | os.PathLike[str], *, salvage: bool = False) -> Trace:
    """Load and validate a trace, streaming it (``memdoctor.trace.stream``) within the caps of
    ``memdoctor.trace.records`` (bytes, record length, records of each type, number size).

    With ``salvage=True`` (used by the supervisor on a crashed run's partial file) a truncated or
    corrupt tail is dropped and ``Trace.truncated`` is set; otherwise it is a ``TraceError``.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    try:
        with p.open("rb") as fh:
            lines = GzipLines(fh, str(p), max_bytes=MAX_DECOMPRESSED_BYTES, max_line=MAX_RECORD_CHARS)
            trace, truncated = _parse(p, lines, salvage)
    except OSError as exc:
        raise TraceError(f"{p}: cannot read the trace ({exc.strerror or exc})") from None
    if lines.truncated and not salvage:
        raise TraceError(f"{p}: the trace is truncated or corrupt (its compressed data ends mid-record)")
    if trace is None:
        raise TraceError(f"{p}: empty trace file (no header record); it is not a complete memdoctor trace")
    if trace.end is None and not salvage:
        # Records are whole gzip members, so a cut at a record boundary still decompresses: the
        # missing end record is what tells a truncated (or still running) trace from a finished one.
        raise TraceError(
            f"{p}: the trace has no end record: it was cut short (truncated, or its run has not "
            "finished); `memdoctor report --salvage` reads what it holds"
        )
    try:
        tracecheck.check_references(trace)
    except ValueError as exc:
        raise TraceError(f"{p}: {_short(exc)}; the trace is corrupt") from None
    trace.truncated = truncated or lines.truncated
    return trace


def _parse(p: Path, lines: GzipLines, salvage: bool) -> tuple[Trace | None, bool]:
    """The trace its lines hold, and whether a bad record cut it short (only with ``salvage``)."""
    with paused_gc():
        return _parse_records(p, lines, salvage)


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a while: while records are parsed, and while a command
    summarises and renders a loaded trace. A trace of 100,000 steps is millions of containers (acyclic:
    JSON values), which the collector walks again and again as more are allocated: with it on, loading
    such a trace takes twice the time, and building its summary's step rows ten times. What is
    allocated meanwhile is freed by reference counting; cycles (matplotlib's figures) wait for the end."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _parse_records(p: Path, lines: GzipLines, salvage: bool) -> tuple[Trace | None, bool]:
    trace: Trace | None = None
    counts: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        try:
            rec = _json(line)
            if trace is None:
                trace = Trace(header=_check_header(p, rec), path=str(p))
                tracecheck.check_header(trace.header)
                continue
            _count(p, counts, rec.get("type"))
            _add_record(trace, rec)
        except TraceError:
            raise
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
            if salvage and trace is not None:
                return trace, True
            raise TraceError(f"{p}: record {n} is invalid ({_short(exc)}); the trace is corrupt") from None
    return trace, False


# A line that may hold a number past MAX_ABS_NUMBER (a run of 41 digits, or an exponent of two digits or
# more) is parsed with the slower per-number checking hooks; others, nearly all, without. The test
# maps each byte to its shape (digit "0", exponent "e", "+", other " ") and searches: both in C, linear.
def _shape_table() -> bytes:
    table = bytearray(b" " * 256)
    for c in b"0123456789":
        table[c] = ord("0")
    table[ord("e")] = table[ord("E")] = ord("e")
    table[ord("+")] = ord("+")
    return bytes(table)


_SHAPE = _shape_table()
_BIG_SHAPES = (b"0" * 41, b"e00", b"e+00")


def _may_be_big(line: bytes) -> bool:
    shape = line.translate(_SHAPE)
    return _BIG_SHAPES[0] in shape or _BIG_SHAPES[1] in shape or _BIG_SHAPES[2] in shape


# orjson reads an integer past 64 bits as a float, the standard library as an int: a line with a run of
# this many digits or more goes to the standard decoder, so that both read every trace alike.
_LONG_DIGITS = b"0" * 19


def _plain_numbers(line: bytes) -> bool:
    return _LONG_DIGITS not in line.translate(_SHAPE)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 40:
        raise ValueError(f"a number of {len(text)} digits (numbers past {MAX_ABS_NUMBER:g} are refused)")
    return _bounded(int(text))


def _bounded_float(text: str) -> float:
    return _bounded(float(text))


def _bounded(value: Any) -> Any:
    if not abs(value) <= MAX_ABS_NUMBER:
        raise ValueError(f"a number past {MAX_ABS_NUMBER:g}")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number a trace may hold")


try:  # optional: a faster parser of the same JSON (a dependency; the standard library where missing)
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised by the tests' fallback case
    _orjson = None  # type: ignore[assignment]

_PLAIN = json.JSONDecoder(parse_constant=_no_constant)
_CHECKED = json.JSONDecoder(parse_int=_bounded_int, parse_float=_bounded_float, parse_constant=_no_constant)


def _scanner(decoder: json.JSONDecoder) -> Callable[[str, int], tuple[Any, int]]:
    """The decoder's own scanner (``scan_once``, which its ``__init__`` sets; the stubs do not list it)."""
    scan: Callable[[str, int], tuple[Any, int]] = vars(decoder)["scan_once"]
    return scan


_PLAIN_SCAN, _CHECKED_SCAN = _scanner(_PLAIN), _scanner(_CHECKED)


def _json(line: bytes) -> dict[str, Any]:
    if not line:
        raise ValueError("an empty line")
    big = _may_be_big(line)
    if _orjson is not None and not big and _plain_numbers(line):
        # orjson parses a record ~3-4x faster than the standard library (most of reading 100,000 steps);
        # it refuses what the checks below refuse too (NaN, Infinity, 64-bit overflows, bad UTF-8), and
        # such a line goes on to the standard decoder, whose error memdoctor reports.
        try:
            rec = _orjson.loads(line)
        except _orjson.JSONDecodeError:
            pass
        else:
            if not isinstance(rec, dict):
                raise ValueError("a record must be a JSON object")
            return rec
    decoder, scan = (_CHECKED, _CHECKED_SCAN) if big else (_PLAIN, _PLAIN_SCAN)
    text = line.decode("utf-8", errors="replace")
    # The decoder's scanner itself, once a record: what ``decode`` does, less two regular-expression
    # matches and two calls. A line that does not end where its JSON value does (spaces around it, or
    # anything after it) goes to ``decode``, which accepts the spaces and words the error.
    try:
        rec, end = scan(text, 0)
    except StopIteration:
        rec, end = None, -1
    if end != len(text):
        rec = decoder.decode(text)
    if not isinstance(rec, dict):
        raise ValueError("a record must be a JSON object")
    return rec


def _count(p: Path, counts: dict[str, int], kind: Any) -> None:
    """Count a record against its type's cap (``MAX_RECORDS``); past it, a ``TraceError`` naming it."""
    key = kind if isinstance(kind, str) and kind in MAX_RECORDS else "other"
    counts[key] = counts.get(key, 0) + 1
    if counts[key] > MAX_RECORDS[key]:
        what = f"{key} records" if key != "other" else "records of unknown types"
        raise TraceError(f"{p}: the trace holds more than the cap of {MAX_RECORDS[key]} {what}; refusing it")


def _check_header(p: Path, rec: dict[str, Any]) -> dict[str, Any]:
    if rec.get("type") != "header" or rec.get("format") != FORMAT_NAME:
        raise TraceError(f"{p}: not a memdoctor trace (first record is not a memdoctor-trace header)")
    version = rec.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(f"{p}: the header's format_version is missing or invalid")
    if version > FORMAT_VERSION:
        raise TraceError(
            f"{p}: trace format version {version} is newer than this memdoctor reads "
            f"(version {FORMAT_VERSION}); upgrade memdoctor (pip install -U memdoctor)"
        )
    header = dict(rec)
    header.pop("type", None)
    return _with_defaults(header)


def _with_defaults(header: dict[str, Any]) -> dict[str, Any]:
    """Optional header fields, filled in (old traces keep loading; readers need not check)."""
    sections: dict[str, dict[str, Any]] = {
        "command": {"argv": [], "script": None, "module": None, "cwd": None},
        "settings": {"warmup": 0, "steps": 0, "budget_bytes": None},
        "device": {
            "kind": "unknown",
            "name": "unknown",
            "total_memory_bytes": None,
            "memory_cap_bytes": None,
        },
        "host": {},
    }
    for key, defaults in sections.items():
        value = header.get(key)
        header[key] = {**defaults, **value} if isinstance(value, dict) else dict(defaults)
    header.setdefault("not_measured", [])
    header.setdefault("applied_config", None)
    return header


def _add_record(trace: Trace, rec: dict[str, Any]) -> None:
    kind = rec.get("type")
    if kind == "model":
        trace.models.append(ModelInfo.from_record(rec))
    elif kind == "step":
        step = StepRecord.from_record(rec)
        tracecheck.check_step(step)
        if trace.steps and trace.steps[-1].step == step.step:
            trace.steps[-1] = step  # a later record of the same step supersedes a provisional one
        else:
            trace.steps.append(step)
    elif kind == "event":
        ev = event_from_record(rec)
        tracecheck.check_event(ev)
        trace.events.append(ev)
    elif kind == "end":
        trace.end = {k: v for k, v in rec.items() if k != "type"}
        tracecheck.check_end(trace.end)
    elif kind == "collector":
        name, data = collector_from_record(rec)
        trace.collected[name] = data
    elif kind == "header":
        raise ValueError("a second header record")
    # Unknown record types come from newer minor versions: ignored, as documented.


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 200 else text[:200] + "..."
