"""The one trace file every later stage reads: capture -> trace -> analysis -> report.

Format (documented field by field in ``docs/trace-format.md``): gzip-compressed JSON Lines. Each record
is one JSON object with a ``type``; the writer compresses every record as its own gzip member and flushes
it, so a process that dies between records leaves every earlier record readable on disk. The first
record is the ``header`` (format name and ``format_version``), then ``model`` records (the module table of
each trained model), ``step`` records (one per optimizer step), ``event`` records (exceptions, OOM,
stops), and a final ``end`` record written by the supervisor that says how the run ended.

Old traces keep loading: fields added later are optional and read with defaults. A trace from a newer
format version, a corrupt or truncated one, is refused with a ``TraceError`` naming the file.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from memdoctor.errors import MemdoctorError, TraceError
from memdoctor.trace import check as tracecheck

FORMAT_NAME = "memdoctor-trace"
FORMAT_VERSION = 1
TRACE_FILENAME = "trace.jsonl.gz"
PARTIAL_SUFFIX = ".partial"

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
PHASES = ("forward", "backward", "optimizer", "other")

# Limits a loader enforces so that a crafted trace cannot exhaust memory or time.
MAX_RECORD_CHARS = 64 * 1024 * 1024
MAX_NAME_CHARS = 4096


@dataclass
class ModelInfo:
    """One trained model: its module table, in ``named_modules()`` order (index 0 is the root)."""

    index: int
    cls: str
    names: list[str]
    types: list[str]
    parents: list[int]
    param_bytes: list[int]  # exclusive (recurse=False), shared storages counted once
    param_counts: list[int]
    trainable_param_bytes: list[int]
    optimizers: list[dict[str, Any]] = field(default_factory=list)

    def display_name(self, i: int) -> str:
        return self.names[i] or f"({self.cls})"

    def to_record(self) -> dict[str, Any]:
        return {
            "type": "model",
            "model": self.index,
            "class": self.cls,
            "optimizers": self.optimizers,
            "modules": {
                "name": self.names,
                "type": self.types,
                "parent": self.parents,
                "param_bytes": self.param_bytes,
                "param_count": self.param_counts,
                "trainable_param_bytes": self.trainable_param_bytes,
            },
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ModelInfo:
        mods = _dict(rec, "modules")
        names = [_name(x) for x in _list(mods, "name")]
        n = len(names)
        return cls(
            index=_int(rec, "model"),
            cls=_name(rec.get("class", "?")),
            names=names,
            types=[_name(x) for x in _list(mods, "type", n)],
            parents=_ints(mods, "parent", n, lo=-1, hi=n - 1),
            param_bytes=_ints(mods, "param_bytes", n),
            param_counts=_ints(mods, "param_count", n),
            trainable_param_bytes=_ints(mods, "trainable_param_bytes", n),
            optimizers=[o for o in rec.get("optimizers", []) if isinstance(o, dict)],
        )


@dataclass
class StepRecord:
    """One optimizer step: timing, memory at its peak, per-module figures and the memory timeline.

    ``modules`` maps a model index to columnar per-module arrays aligned with that model's module table:
    ``activation_bytes`` (inclusive of submodules), ``activation_self_bytes``, ``checkpoint_free_bytes``,
    ``grad_bytes``, ``optimizer_state_bytes`` (exclusive), ``forward_ms``, ``backward_ms`` (inclusive),
    ``calls``. ``timeline`` is columnar too: ``t_ms``, ``event``, ``phase``, ``model``, ``module`` and
    one column per memory figure (``parameters``, ``gradients``, ``optimizer_state``, ``activations``,
    and on CUDA ``allocated``, ``reserved``, ``max_allocated``; ``None`` columns were not measured).
    """

    step: int
    warmup: bool
    complete: bool
    duration_ms: float | None
    phases_ms: dict[str, float]
    micro_batches: int
    memory: dict[str, Any]
    modules: dict[int, dict[str, list[Any]]]
    timeline: dict[str, list[Any] | None]
    timeline_stride: int = 1
    detail: str = "full"  # "full": the per-module ledger; "timing": step time and allocator peak only
    grad_norm: dict[str, Any] | None = None  # {global, nonfinite_modules, first_nonfinite}, when measured
    # {scale, skipped} when a torch.amp.GradScaler stepped in this step (memdoctor.capture.gradscaler)
    grad_scaler: dict[str, Any] | None = None
    # What each collector measured in this step (memdoctor.capture.collectors): name -> its data.
    collectors: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "type": "step",
            "detail": self.detail,
            **({"grad_norm": self.grad_norm} if self.grad_norm is not None else {}),
            **({"grad_scaler": self.grad_scaler} if self.grad_scaler is not None else {}),
            **({"collectors": self.collectors} if self.collectors else {}),
            "step": self.step,
            "warmup": self.warmup,
            "complete": self.complete,
            "duration_ms": self.duration_ms,
            "phases_ms": self.phases_ms,
            "micro_batches": self.micro_batches,
            "memory": self.memory,
            "modules": {str(k): v for k, v in self.modules.items()},
            "timeline": self.timeline,
            "timeline_stride": self.timeline_stride,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> StepRecord:
        mods = _dict(rec, "modules")
        modules: dict[int, dict[str, list[Any]]] = {}
        for key, cols in mods.items():
            if not isinstance(cols, dict):
                raise ValueError("step.modules entries must be objects")
            modules[_as_int(key, "step.modules key")] = {k: _numbers(v, k) for k, v in cols.items()}
        timeline = {k: (None if v is None else _list_of(v, k)) for k, v in _dict(rec, "timeline", {}).items()}
        memory = _dict(rec, "memory")
        _check_nonneg(memory.get("peak_bytes"), "memory.peak_bytes")
        return cls(
            step=_int(rec, "step"),
            warmup=bool(rec.get("warmup", False)),
            complete=bool(rec.get("complete", True)),
            duration_ms=_opt_float(rec.get("duration_ms")),
            phases_ms={str(k): float(v) for k, v in _dict(rec, "phases_ms", {}).items()},
            micro_batches=_int(rec, "micro_batches", 1),
            memory=memory,
            modules=modules,
            timeline=timeline,
            timeline_stride=_int(rec, "timeline_stride", 1),
            detail="timing" if rec.get("detail") == "timing" else "full",
            grad_norm=rec["grad_norm"] if isinstance(rec.get("grad_norm"), dict) else None,
            grad_scaler=_grad_scaler(rec.get("grad_scaler")),
            collectors=_dict(rec, "collectors", {}),
        )


def _grad_scaler(value: Any) -> dict[str, Any] | None:
    """``{scale: positive finite number or None, skipped: bool}``, or None (absent or malformed)."""
    if not isinstance(value, dict):
        return None
    scale = value.get("scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf")):
        scale = None
    return {"scale": None if scale is None else float(scale), "skipped": value.get("skipped") is True}


@dataclass
class Trace:
    """A loaded trace: what every analysis, plot and exporter reads."""

    header: dict[str, Any]
    models: list[ModelInfo] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    # Run-wide facts from collectors (``collector`` records): name -> data; the last record wins.
    collected: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: str | None = None
    truncated: bool = False  # only ever True for a trace loaded with salvage=True

    @property
    def device(self) -> dict[str, Any]:
        return self.header.get("device") or {}

    @property
    def settings(self) -> dict[str, Any]:
        return self.header.get("settings") or {}

    def profiled_steps(self) -> list[StepRecord]:
        """Complete, non-warmup steps; the figures a report leads with."""
        return [s for s in self.steps if s.complete and not s.warmup]

    def detailed_steps(self) -> list[StepRecord]:
        """Profiled steps that carry the per-module ledger (all of them, unless timing steps were used)."""
        return [s for s in self.profiled_steps() if s.detail == "full"]

    def records(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [dict(self.header, type="header")]
        out += [m.to_record() for m in self.models]
        out += [s.to_record() for s in self.steps]
        out += [dict(e, type="event") for e in self.events]
        out += [{"type": "collector", "name": k, "data": v} for k, v in self.collected.items()]
        if self.end is not None:
            out.append(dict(self.end, type="end"))
        return out


def make_header(**fields: Any) -> dict[str, Any]:
    """A header record with the format name and version filled in."""
    return {"type": "header", "format": FORMAT_NAME, "format_version": FORMAT_VERSION, **fields}


# ----------------------------------------------------------------------------------------- writing


class TraceWriter:
    """Appends records to a trace file, one gzip member per record, flushed as written.

    A flushed record is in the operating system's hands and survives the death of the process (the
    crashes memdoctor is built for); ``fsync=True`` also survives a machine crash, at a few ms a record.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._fh: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            raise ValueError("trace writer is closed")
        line = json.dumps(
            record, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_json_default
        )
        self._fh.write(gzip.compress(line.encode() + b"\n", compresslevel=6, mtime=0))
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


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


# ----------------------------------------------------------------------------------------- reading


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
        ev = {k: v for k, v in rec.items() if k != "type"}
        ev["kind"] = _name(ev.get("kind", "note"))
        ev["message"] = str(ev.get("message", ""))[: MAX_NAME_CHARS * 4]
        tracecheck.check_event(ev)
        trace.events.append(ev)
    elif kind == "end":
        trace.end = {k: v for k, v in rec.items() if k != "type"}
        tracecheck.check_end(trace.end)
    elif kind == "collector":
        trace.collected[_name(rec.get("name"))] = _dict(rec, "data", {})
    elif kind == "header":
        raise ValueError("a second header record")
    # Unknown record types come from newer minor versions: ignored, as documented.


# ----------------------------------------------------------------------------------------- validation
def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 200 else text[:200] + "..."


def _dict(rec: dict[str, Any], key: str, default: dict[str, Any] | None = None) -> dict[str, Any]:
    value = rec.get(key, default)
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object")
    return value


def _list(rec: dict[str, Any], key: str, n: int | None = None) -> list[Any]:
    value = rec.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list")
    if n is not None and len(value) != n:
        raise ValueError(f"{key} has {len(value)} entries, expected {n}")
    return value


def _list_of(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list")
    return value


def _numbers(value: Any, key: str) -> list[Any]:
    items = _list_of(value, key)
    for x in items:
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise ValueError(f"{key} must hold numbers")
        if isinstance(x, (int, float)) and (not math.isfinite(x) or x < 0):
            raise ValueError(f"{key} holds a negative or non-finite value")
    return items


def _ints(rec: dict[str, Any], key: str, n: int, lo: int = 0, hi: int | None = None) -> list[int]:
    items = _list(rec, key, n)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
            raise ValueError(f"{key} must hold whole numbers >= {lo}")
    return items


def _int(rec: dict[str, Any], key: str, default: int | None = None) -> int:
    value = rec.get(key, default)
    return _as_int(value, key)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a whole number >= 0")
    return value


def _opt_float(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError("a duration must be a number >= 0")
    return float(value)


def _check_nonneg(value: Any, what: str) -> None:
    if value is not None and (not isinstance(value, (int, float)) or value < 0):
        raise ValueError(f"{what} must be a number >= 0")


def _name(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_NAME_CHARS:
        raise ValueError(f"a name is longer than {MAX_NAME_CHARS} characters")
    return text
