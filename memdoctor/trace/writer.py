"""Writing a trace: one gzip member per record, flushed as written, and a whole trace saved atomically."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from memdoctor.outputs import file_mode
from memdoctor.trace.records import MAX_DECOMPRESSED_BYTES, MAX_RECORD_CHARS, MAX_RECORDS, Trace
from memdoctor.trace.redact import redact_record

# Bytes of the whole trace kept free for the records that end it (events of how the run ended, the end
# record): past MAX_DECOMPRESSED_BYTES less this, other records are dropped, so that the end still fits.
END_RESERVE = 1 << 20


class TraceWriter:
    """Appends records to a trace file, one gzip member per record, flushed as written.

    A flushed record is in the operating system's hands and survives the death of the process (the
    crashes memdoctor is built for); ``fsync=True`` also survives a machine crash, at a few ms a record.

    ``on_error``: records are written from inside the script's own calls (module and optimizer hooks),
    so a failed write (a full disk, a file made unwritable) must never raise into the script. With
    ``on_error`` set, the first ``OSError`` marks the writer failed (every later ``write`` does nothing)
    and is handed to ``on_error``, which decides what happens to the run; the records flushed before it
    stay readable (``load_trace(salvage=True)`` stops at the last whole one). Without it, it raises.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        on_error: Callable[[OSError], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._on_error = on_error
        self.failed: OSError | None = None  # the write error that stopped recording (with on_error)
        self.records_written = 0
        self.dropped: dict[str, int] = {}  # records left out to stay within the reader's caps, per type
        self._counts: dict[str, int] = {}
        self._bytes = 0  # decompressed bytes written
        self._fh: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self.failed is not None:
            return
        if self._fh is None:
            raise ValueError("trace writer is closed")
        record = redact_record(record)  # secrets never reach the file (memdoctor.trace.redact)
        data = fit_line(record)
        if not self._admit(record.get("type"), len(data) + 1):
            return
        try:
            self._append(gzip.compress(data + b"\n", compresslevel=6, mtime=0))
        except OSError as exc:
            if self._on_error is None:
                raise
            self.failed = exc
            self._on_error(exc)
            return
        self.records_written += 1
        self._bytes += len(data) + 1

    def _admit(self, kind: Any, size: int) -> bool:
        """Whether a record of ``kind`` and ``size`` bytes stays within the reader's caps on records per
        type and on decompressed bytes (``memdoctor.trace.records``); one that would not is dropped
        and counted in ``dropped``, so that the trace written is one the reader accepts."""
        key = kind if isinstance(kind, str) and kind in MAX_RECORDS else "other"
        room = MAX_DECOMPRESSED_BYTES - self._bytes - (0 if key in ("end", "event") else END_RESERVE)
        if self._counts.get(key, 0) >= MAX_RECORDS[key] or size > room:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self._counts[key] = self._counts.get(key, 0) + 1
        return True

    def _append(self, member: bytes) -> None:
        assert self._fh is not None
        self._fh.write(member)
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            try:
                fh.close()
            except OSError:  # the buffered tail of a failed write: what was flushed stays readable
                if self.failed is None and self._on_error is None:
                    raise


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write a whole trace atomically (temp file in the same folder, then rename)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl.gz", dir=target.parent)
    os.close(fd)
    try:
        writer = TraceWriter(tmp, fsync=False)
        for rec in trace.records():
            writer.write(rec)
        writer.close()
        os.chmod(tmp, file_mode())  # mkstemp's 0o600 would keep the trace from a shared folder
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def fit_line(record: dict[str, Any]) -> bytes:
    """The record as one line of JSON within the reader's ``MAX_RECORD_CHARS``.

    A step record over it (a model of a million modules: its memory timeline) keeps every other sample
    of its timeline, and ``timeline_stride`` says so, until it fits; without its timeline still over
    it, it becomes a timing step (``detail: timing``: no per-module ledger). Any other record over it
    is refused with a ``ValueError`` naming the cap: a record the reader would refuse is never written.
    """
    line = _dumps(record)
    if len(line) <= MAX_RECORD_CHARS:
        return line
    if record.get("type") == "step":
        record = dict(record)
        while isinstance(tl := record.get("timeline"), dict) and max(map(_len, tl.values()), default=0) > 1:
            record["timeline"] = {k: (None if v is None else v[::2]) for k, v in tl.items()}
            record["timeline_stride"] = int(record.get("timeline_stride") or 1) * 2
            if len(line := _dumps(record)) <= MAX_RECORD_CHARS:
                return line
        record.update(detail="timing", modules={}, timeline={}, timeline_stride=1)
        memory = record.get("memory")
        if isinstance(memory, dict):
            record["memory"] = {**memory, "categories_at_peak": None, "peak_model": None, "peak_module": None}
        if len(line := _dumps(record)) <= MAX_RECORD_CHARS:
            return line
    raise ValueError(
        f"a {record.get('type')} record of {len(line)} bytes is larger than the trace's cap of "
        f"{MAX_RECORD_CHARS} bytes a record"
    )


def _len(column: Any) -> int:
    return len(column) if isinstance(column, list) else 0


def _dumps(record: dict[str, Any]) -> bytes:
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_json_default)
    return text.encode()


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars reach us from collectors; plain numbers in the file.
    for attr in ("item", "tolist"):
        if hasattr(obj, attr):
            return getattr(obj, attr)()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
