"""Writing a trace: one gzip member per record, flushed as written, and a whole trace saved atomically."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from memdoctor.trace.records import Trace
from memdoctor.trace.redact import redact_record


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
        self._fh: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self.failed is not None:
            return
        if self._fh is None:
            raise ValueError("trace writer is closed")
        record = redact_record(record)  # secrets never reach the file (memdoctor.trace.redact)
        line = json.dumps(
            record, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_json_default
        )
        try:
            self._append(gzip.compress(line.encode() + b"\n", compresslevel=6, mtime=0))
        except OSError as exc:
            if self._on_error is None:
                raise
            self.failed = exc
            self._on_error(exc)
            return
        self.records_written += 1

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
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars reach us from collectors; plain numbers in the file.
    for attr in ("item", "tolist"):
        if hasattr(obj, attr):
            return getattr(obj, attr)()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
