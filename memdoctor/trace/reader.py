"""Reading a trace back: concatenated gzip members, one JSON record a line, checked as they are read.

The writer flushes every record as its own gzip member, so a process that dies between records leaves
every earlier record readable; a cut or corrupt tail is refused, or dropped with ``salvage=True``. A
trace from a newer format version is refused with a ``TraceError`` naming the file, as is one whose
records fail their checks (``memdoctor.trace.check``).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from memdoctor.errors import MemdoctorError, TraceError
from memdoctor.trace import check as tracecheck
from memdoctor.trace.records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_RECORD_CHARS,
    ModelInfo,
    StepRecord,
    Trace,
    collector_from_record,
    event_from_record,
)


def read_trace(path: str | os.PathLike[str] | None) -> Trace | None:
    """The trace at ``path``; None when there is none or it cannot be read (for callers that say so
    their own way: a run's summary table, a verify or re-profile round's record)."""
    try:
        return load_trace(path) if path is not None else None
    except MemdoctorError:
        return None


def load_trace(path: str | os.PathLike[str], *, salvage: bool = False) -> Trace:
    """Load and validate a trace.

    With ``salvage=True`` (used by the supervisor on a crashed run's partial file) a truncated or
    corrupt tail is dropped and ``Trace.truncated`` is set; otherwise it is a ``TraceError``.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    lines, truncated = _read_lines(p, salvage)
    if not lines:
        raise TraceError(f"{p}: empty trace file (no header record); it is not a complete memdoctor trace")
    trace: Trace | None = None
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("a record must be a JSON object")
            if trace is None:
                trace = Trace(header=_check_header(p, rec), path=str(p))
                tracecheck.check_header(trace.header)
                continue
            _add_record(trace, rec)
        except TraceError:
            raise
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
            if salvage and trace is not None:
                truncated = True
                break
            raise TraceError(f"{p}: record {n} is invalid ({_short(exc)}); the trace is corrupt") from None
    if trace is None:
        raise TraceError(f"{p}: no header record; not a memdoctor trace")
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
    trace.truncated = truncated
    return trace


def _read_lines(p: Path, salvage: bool) -> tuple[list[str], bool]:
    data = p.read_bytes()
    if data[:2] != b"\x1f\x8b":
        raise TraceError(f"{p}: not a gzip file; a memdoctor trace is gzip-compressed JSON Lines")
    text, truncated = _gunzip_members(data)
    if truncated and not salvage:
        raise TraceError(f"{p}: the trace is truncated or corrupt (its compressed data ends mid-record)")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:  # last line without newline: an incomplete record
        if not salvage:
            raise TraceError(f"{p}: the trace is truncated (its last record is incomplete)")
        lines.pop()
        truncated = True
    for n, line in enumerate(lines, 1):
        if len(line) > MAX_RECORD_CHARS:
            raise TraceError(f"{p}: record {n} is larger than {MAX_RECORD_CHARS} characters")
    return lines, truncated


def _gunzip_members(data: bytes) -> tuple[str, bool]:
    """Decompress concatenated gzip members; report whether the tail was cut or corrupt."""
    out: list[bytes] = []
    pos, total = 0, 0
    while pos < len(data):
        d = zlib.decompressobj(wbits=31)
        try:
            chunk = d.decompress(data[pos:], MAX_RECORD_CHARS * 4)
        except zlib.error:
            return _decode(out), True
        total += len(chunk)
        if total > MAX_RECORD_CHARS * 16:
            raise TraceError("trace decompresses to more than 1 GiB; refusing to load it")
        if not d.eof:
            return _decode(out), True
        out.append(chunk)
        pos = len(data) - len(d.unused_data)
    return _decode(out), False


def _decode(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", errors="replace")


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
