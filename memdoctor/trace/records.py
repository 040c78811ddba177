"""The trace's records as Python objects, and back: ``header``, ``model``, ``step``, ``event``, ``end``.

Format (documented field by field in ``docs/trace-format.md``): gzip-compressed JSON Lines. Each record
is one JSON object with a ``type``. The first record is the ``header`` (format name and
``format_version``), then ``model`` records (the module table of each trained model), ``step`` records
(one per optimizer step), ``event`` records (exceptions, OOM, stops), and a final ``end`` record that
says how the run ended. Each kind's shape is defined here, once, for every stage that writes one.

Old traces keep loading: fields added later are optional and read with defaults, and a record's
fields are read defensively (a wrong type or a negative size is a ``ValueError`` the reader turns into
a ``TraceError`` naming the file).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, TypeVar

from memdoctor.units import MAX_NAME_CHARS

T = TypeVar("T")

FORMAT_NAME = "memdoctor-trace"
FORMAT_VERSION = 1
TRACE_FILENAME = "trace.jsonl.gz"
PARTIAL_SUFFIX = ".partial"

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
PHASES = ("forward", "backward", "optimizer", "other")

# Limits a loader enforces so that a crafted trace cannot exhaust memory or time (docs/trace-format.md).
# Capture keeps within them: a longer module name is cut the same way everywhere (``fit_name``).
MAX_RECORD_CHARS = 64 * 1024 * 1024  # one record (line), in bytes of JSON
MAX_MESSAGE_CHARS = MAX_NAME_CHARS * 4  # an event's or the end's message, as written and as read
MAX_DECOMPRESSED_BYTES = 1024**3  # the whole trace, decompressed
MAX_ABS_NUMBER = 1e40  # any number in any record: past this, figures overflow when summed or scaled
# Records of each type a trace may hold; "other" counts the unknown types of newer minor versions.
MAX_RECORDS = {
    "header": 1,
    "model": 1_000,
    "step": 1_000_000,
    "event": 1_000_000,
    "collector": 10_000,
    "end": 100,
    "other": 100_000,
}


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
    # {ms, calls, bytes, by_op, ...}: this rank's time in torch.distributed's collectives in the step
    # (memdoctor.capture.collectives); None in one process and in older traces.
    collectives: dict[str, Any] | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "type": "step",
            "detail": self.detail,
            **({"grad_norm": self.grad_norm} if self.grad_norm is not None else {}),
            **({"grad_scaler": self.grad_scaler} if self.grad_scaler is not None else {}),
            **({"collectors": self.collectors} if self.collectors else {}),
            **({"collectives": self.collectives} if self.collectives is not None else {}),
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
        modules = {
            _as_int(key, "step.modules key"): _columns(cols) for key, cols in _dict(rec, "modules").items()
        }
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
            collectives=_collectives(rec.get("collectives")),
        )


def _collectives(value: Any) -> dict[str, Any] | None:
    """The step's ``collectives`` where its totals are numbers (``ms``, ``calls``, ``bytes``) and
    ``by_op`` maps names to such rows; None (not measured) for anything else."""

    def figure(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf

    def row(v: Any) -> bool:
        return isinstance(v, dict) and all(figure(v.get(k)) for k in ("ms", "calls", "bytes"))

    if not row(value) or not isinstance(value.get("by_op", {}), dict):
        return None
    if not all(row(v) for v in value.get("by_op", {}).values()):
        return None
    return dict(value)


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
    # Figures over every step, computed once while the trace is ``frozen`` (see there); None: not frozen.
    _memo: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @contextmanager
    def frozen(self) -> Iterator[Trace]:
        """A stretch in which the trace does not change (a summary or report being built from it), so
        that what every analysis asks of all its steps (the profiled steps, the peak step) is found once,
        not once per question: ten passes over 100,000 steps each cost a second. Re-entrant; outside
        it, nothing is remembered, so a trace being recorded or edited is always read afresh."""
        if self._memo is not None:
            yield self
            return
        self._memo = {}
        try:
            yield self
        finally:
            self._memo = None

    def cached(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()``, once per ``key`` while the trace is ``frozen``; every call outside it."""
        if self._memo is None:
            return compute()
        if key not in self._memo:
            self._memo[key] = compute()
        value: T = self._memo[key]
        return value

    @property
    def device(self) -> dict[str, Any]:
        return self.header.get("device") or {}

    @property
    def settings(self) -> dict[str, Any]:
        return self.header.get("settings") or {}

    def profiled_steps(self) -> list[StepRecord]:
        """Complete, non-warmup steps; the figures a report leads with. (A new list: callers may edit it.)"""
        return list(self.cached("profiled", lambda: [s for s in self.steps if s.complete and not s.warmup]))

    def detailed_steps(self) -> list[StepRecord]:
        """Profiled steps that carry the per-module ledger (all of them, unless timing steps were used)."""
        return list(self.cached("detailed", lambda: [s for s in self.profiled_steps() if s.detail == "full"]))

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


def run_settings(warmup: int, steps: int, budget_bytes: int | None, gpu: str | None = None) -> dict[str, Any]:
    """The header's ``settings``: the steps asked for, the memory budget (``--budget``, or ``--gpu``'s
    card memory), and ``gpu``, the card the run was profiled for (``memdoctor.cards`` key), only when
    one was named (format 1.x readers that do not know it ignore it)."""
    out: dict[str, Any] = {"warmup": warmup, "steps": steps, "budget_bytes": budget_bytes}
    if gpu is not None:
        out["gpu"] = gpu
    return out


def distributed_info(
    *, rank: int, world_size: int, local_rank: int, backend: str | None = None, master: str | None = None
) -> dict[str, Any]:
    """The header's ``distributed``: which rank of a multi-process job (``torch.distributed.run``) wrote
    the trace. ``backend`` is the default process group's (``gloo``, ``nccl``) once the script had made
    it, else None; ``master`` is ``host:port`` of the rendezvous. Absent in a one-process trace, and an
    optional header field of format 1 (readers that do not know it ignore it)."""
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "backend": backend,
        "master": master,
    }


def distributed_of(header: dict[str, Any]) -> dict[str, Any] | None:
    """The header's ``distributed``, or None for a one-process trace (or one whose field is malformed:
    rank and world size must be whole numbers with rank < world size)."""
    value = header.get("distributed")
    if not isinstance(value, dict):
        return None
    rank, world = value.get("rank"), value.get("world_size")
    if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
        return None
    local = value.get("local_rank")
    backend, master = value.get("backend"), value.get("master")
    return distributed_info(
        rank=rank,
        world_size=world,
        local_rank=local if type(local) is int and local >= 0 else rank,
        backend=backend if isinstance(backend, str) else None,
        master=master if isinstance(master, str) else None,
    )


def make_end(
    *,
    status: str | None,
    message: str,
    steps_recorded: int,
    duration_s: float,
    exit_code: int | None = None,
    signal: str | None = None,
    memdoctor_exit_code: int | None = None,
) -> dict[str, Any]:
    """The ``end`` record (as ``Trace.end`` holds it, without its ``type``): how the run ended.

    ``exit_code`` and ``signal`` are the script process's (None for an in-process run, which has no
    process of its own); ``memdoctor_exit_code`` is what ``memdoctor profile`` returned for it."""
    return {
        "status": status,
        "exit_code": exit_code,
        "signal": signal,
        "message": message[:MAX_MESSAGE_CHARS],  # what a reader keeps of it
        "steps_recorded": steps_recorded,
        "duration_s": round(duration_s, 3),
        "memdoctor_exit_code": memdoctor_exit_code,
    }


def unfinished_end(steps_recorded: int) -> dict[str, Any]:
    """The end a salvaged trace is read with when its run wrote none: no status, since how the run
    ended is not known (the report says "unknown")."""
    msg = "the trace has no end record: the run was cut short (or is still running)"
    return {"message": msg, "steps_recorded": steps_recorded}


def event_record(
    kind: str, message: str, where: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """An ``event`` record: what happened (``kind``, a one-line ``message``), when (``t_unix``), where
    the script was (``where``: its step, phase and module), and the ``fields`` of its kind."""
    return {
        "type": "event",
        "kind": kind,
        "message": message[:MAX_MESSAGE_CHARS],  # what a reader keeps of it
        "t_unix": time.time(),
        **(where or {}),
        **fields,
    }


def event_from_record(rec: dict[str, Any]) -> dict[str, Any]:
    """An event as ``Trace.events`` holds it: without its ``type``, its kind and message bounded."""
    ev = {k: v for k, v in rec.items() if k != "type"}
    ev["kind"] = _name(ev.get("kind", "note"))
    ev["message"] = str(ev.get("message", ""))[:MAX_MESSAGE_CHARS]
    return ev


def collector_from_record(rec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``collector`` record's (name, data)."""
    return _name(rec.get("name")), _dict(rec, "data", {})


# ----------------------------------------------------------------------------------------- fields
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


_NONE = type(None)
_NUMBER_TYPES = frozenset((int, float, _NONE))


def _numbers(value: Any, key: str) -> list[Any]:
    """A column of numbers >= 0 and None. Checked a column at a time (its types as a set, its minimum
    and its sum, all in C): a trace of 100,000 steps holds tens of millions of them."""
    items = _list_of(value, key)
    if set(map(type, items)) <= _NUMBER_TYPES:  # no bool, str, list ...
        nums = [x for x in items if x is not None]
        if not nums or (min(nums) >= 0 and math.isfinite(sum(nums))):
            return items
    for x in items:  # find the offending value, for the message
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise ValueError(f"{key} must hold numbers")
        if isinstance(x, (int, float)) and (not math.isfinite(x) or x < 0):
            raise ValueError(f"{key} holds a negative or non-finite value")
    return items


def _columns(cols: Any) -> dict[str, list[Any]]:
    """A model's per-module columns of one step: lists of numbers >= 0 and None, all of them checked at
    once (one list, its types as a set, its minimum and sum): a step of a small model would otherwise
    cost more in calls per column than in values."""
    if not isinstance(cols, dict):
        raise ValueError("step.modules entries must be objects")
    if all(type(v) is list for v in cols.values()):
        items = list(chain.from_iterable(cols.values()))
        types = set(map(type, items))
        if types <= _NUMBER_TYPES:
            nums = [x for x in items if x is not None] if _NONE in types else items  # most have no None
            if not nums or (min(nums) >= 0 and math.isfinite(sum(nums))):
                return cols
    return {k: _numbers(v, k) for k, v in cols.items()}  # finds the offending column, for the message


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
    if type(value) is int and value >= 0:  # nearly always: the rest of the checks, for the others
        return value
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
