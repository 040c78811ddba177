"""Host<->device transfers: every copy between the CPU and the GPU a training step makes, and its cost.

Interception. The copies training scripts make go through a handful of Python entry points:
``Tensor.to`` / ``.cuda`` / ``.cpu`` / ``.copy_`` (``nn.Module.to``, HF's ``_prepare_input``,
accelerate's ``send_to_device`` and Lightning's ``batch_to_device`` all end there), ``torch.tensor`` /
``torch.as_tensor`` with a device, and the reads that wait for the GPU: ``.item()``, ``.tolist()``,
``.numpy(force=True)``, ``bool()``, ``float()``, ``int()`` of a device tensor. ``TransferCollector``
wraps exactly those for the profiled steps and puts the originals back on ``stop``. A wrapper that is
not looking at a transfer (a dtype cast, a CPU tensor's ``.item()``) costs a few attribute reads.

Why not a ``TorchDispatchMode``: it sees every copy, including those torch makes internally, but it
runs Python for every operator of the step, which a launch-bound step (hundreds of small kernels)
would feel as a slowdown of several times; issue 3 allows 1.5x at most. Copies made inside C++ (a
``DataParallel`` scatter, NCCL) are not seen by the wrappers; the PCIe counters below still see their
bytes.

Each transfer records its bytes, direction (``h2d``/``d2h``), whether the host side is pinned,
``non_blocking``, the step, phase and innermost module (``session.current_*``), the source line that
made it (the first frame outside torch), and its cost: host wall time for a synchronous copy or read
(the time the script stood still, including the wait for GPU work queued before it), a pair of device
markers (CUDA events) for a ``non_blocking`` copy, resolved to the copy's device time in
``step_field``. Calls memdoctor itself makes (reading its own figures back) are not recorded.

While the steps run, a background thread samples NVML's PCIe throughput counters (TX: device to host,
RX: host to device), so traffic the wrappers cannot see still shows. Each NVML read blocks for its
~20 ms measuring window, so the thread reads every ``sample_interval_s`` and never on the script's
thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from memdoctor import patching
from memdoctor.capture.collectors import Collector, CollectorUnavailable
from memdoctor.device import Device, nvml

COPY_CAP = 256  # copies listed one by one per step; the rest are aggregated
TIMED_CAP = 64  # non-blocking copies per step that get a device-marker pair
PCIE_SAMPLES_CAP = 200  # PCIe samples per step in the trace
SAMPLE_INTERVAL_S = 0.1
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
READ_OPS = frozenset(n.strip("_") for n in READS)  # the ``op`` a read is logged as

Reader = Callable[[], "tuple[int, int] | None"]
# Under torch.compile, dynamo traces into the wrappers: the first thing each does is this check (which
# dynamo understands), so a compiled region sees the original call and no bookkeeping to trace.
_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_HERE = globals()


class TransferCollector(Collector):
    """Wraps torch's copy entry points during the profiled steps; per step: bytes, copies, time."""

    name = "transfers"

    def __init__(
        self,
        device: Device | None = None,
        *,
        accelerator: str | None = None,
        is_pinned: Callable[[torch.Tensor], bool] | None = None,
        pcie_reader: Reader | None = None,
        sample_interval_s: float = SAMPLE_INTERVAL_S,
        **_: Any,
    ) -> None:
        # ``accelerator``: the device type that counts as "the GPU"; tests use ``meta`` so that a CPU
        # machine can make a host-to-device copy of known size.
        if accelerator is None:
            if device is None or device.kind != "cuda":
                raise CollectorUnavailable("no CUDA device: there are no host-device copies to measure")
            accelerator = "cuda"
        self.accel = accelerator
        self.device = device
        self.is_pinned = is_pinned or _is_pinned
        self.pcie_reader = pcie_reader
        self.interval = sample_interval_s
        self.session: Any = None
        self.active = False
        self.local = threading.local()
        self.logs: dict[int, StepLog] = {}
        self.fields: dict[int, tuple[int, dict[str, Any]]] = {}
        self.patches: list[patching.Undo] = []
        self.sampler: PcieSampler | None = None
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, session: Any) -> None:
        self.session = session
        if self.device is None:
            self.device = session.device
        self.t0 = time.perf_counter()
        notes = self._start_sampler()
        try:
            self._install()
        except BaseException:
            self.stop()
            raise
        self.active = True
        session.emit(
            self.name,
            {
                "accelerator": self.accel,
                "copy_cap": COPY_CAP,
                "timed_cap": TIMED_CAP,
                "pcie_interval_s": self.interval if self.sampler is not None else None,
                "not_measured": notes,
            },
        )

    def stop(self) -> None:
        self.active = False
        self._uninstall()
        if self.sampler is not None:
            self.sampler.halt()
            self.sampler.join(timeout=5.0)

    def _start_sampler(self) -> list[str]:
        reader, why = self.pcie_reader, None
        if reader is None:
            index = getattr(self.device, "index", None)
            dev, why = nvml.open_device(index) if isinstance(index, int) else (None, "no CUDA device")
            reader = dev.pcie_throughput if dev is not None else None
        if reader is None:
            return [f"PCIe throughput counters: {why}"]
        self.sampler = PcieSampler(reader, self.interval, self._sample_step)
        self.sampler.start()
        return []

    def _sample_step(self) -> int:
        return int(self.session.current_step()) if self.session is not None else 0

    # ------------------------------------------------------------------------------ patches
    def _install(self) -> None:
        tensor = torch.Tensor
        for name, make in _TENSOR_WRAPPERS.items():
            self._patch(tensor, name, make)
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, _wrap_factory)

    def _patch(self, owner: Any, name: str, make: Callable[..., Any]) -> None:
        self.patches.append(patching.wrap_attr(owner, name, lambda original: make(self, original, name)))

    def _uninstall(self) -> None:
        """Put every original back (a method torch.Tensor inherited is deleted again, not set). One that
        someone wrapped again after us stays (``memdoctor.patching``), and our wrapper under it passes
        calls through."""
        while self.patches:
            self.patches.pop()()

    # ------------------------------------------------------------------------------ recording
    def busy(self) -> bool:
        """True inside one of our wrappers (nested calls pass through) or when switched off."""
        return not self.active or getattr(self.local, "busy", False)

    def transfer(
        self,
        op: str,
        direction: str,
        host: torch.Tensor | None,
        nbytes: int,
        non_blocking: bool,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``fn(*args, **kwargs)``, a copy or read of ``nbytes`` (-1: the result's size), and log
        it. ``host`` is the host side when it exists before the call (h2d); else the result is."""
        try:
            pending = self._begin(op, direction, host, nbytes, non_blocking)
        except Exception:  # bookkeeping must never fail the script's copy
            pending = None
        if pending is None:
            return self._run(fn, args, kwargs)
        t = time.perf_counter()
        out = self._run(fn, args, kwargs)
        host_ms = (time.perf_counter() - t) * 1000.0
        with contextlib.suppress(Exception):  # bookkeeping must never fail the script's copy
            self._end(pending, out, host_ms)
        return out

    def _begin(
        self, op: str, direction: str, host: torch.Tensor | None, nbytes: int, non_blocking: bool
    ) -> list[Any] | None:
        site = _site()
        if site is None:  # memdoctor reading its own figures
            return None
        session = self.session
        step = session.current_step()
        log = self.logs.get(step)
        if log is None:
            log = self.logs[step] = StepLog()
        pinned = bool(self.is_pinned(host)) if host is not None else False
        timed = non_blocking and log.timed < TIMED_CAP and len(log.copies) < COPY_CAP
        marks = [self.device.marker()] if timed else None  # type: ignore[union-attr]
        where = (session.current_phase(), session.current_module(), site)
        return [log, op, direction, host, nbytes, bool(non_blocking), pinned, where, marks]

    def _end(self, pending: list[Any], out: Any, host_ms: float) -> None:
        log, op, direction, host, nbytes, nb, pinned, (phase, where, site), marks = pending
        if marks is not None:
            marks.append(self.device.marker())  # type: ignore[union-attr]
            log.timed += 1
        is_tensor = isinstance(out, torch.Tensor)
        if nbytes < 0:
            nbytes = int(out.nbytes) if is_tensor else 0
        if host is None and direction == "d2h" and op not in READ_OPS and is_tensor:
            pinned = bool(self.is_pinned(out))  # .to("cpu", non_blocking=True) lands in pinned memory
        log.add((op, direction, nbytes, pinned, nb, not nb, phase, where, site, host_ms, marks))

    def pin(self, fn: Callable[..., Any], tensor: torch.Tensor, args: Any, kwargs: Any) -> Any:
        """``.pin_memory()``: a host-to-host copy into pinned memory, counted per step (not a transfer)."""
        out = self._run(fn, (tensor, *args), kwargs)
        try:
            if _site() is not None:
                step = self.session.current_step()
                log = self.logs.get(step) or self.logs.setdefault(step, StepLog())
                log.pinned_bytes += int(tensor.nbytes)
                log.pinned_calls += 1
        except Exception:  # bookkeeping must never fail the script's call
            pass
        return out

    def _run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        local = self.local
        local.busy = True
        try:
            return fn(*args, **kwargs)
        finally:
            local.busy = False

    # ------------------------------------------------------------------------------ per step
    def step_field(self, step: int) -> Any:
        log = self.logs.get(step)
        samples = self.sampler.for_step(step, self.t0) if self.sampler is not None else None
        if log is None and not samples:
            return None
        log = log or StepLog()
        key = (len(log.copies), log.more_count, len(samples or ()))
        cached = self.fields.get(step)
        if cached is not None and cached[0] == key:
            return cached[1]
        field = log.to_field(self.device)  # type: ignore[arg-type]
        field["pcie"] = pcie_field(samples) if samples is not None else None
        self.fields[step] = (key, field)  # type: ignore[assignment]
        for old in [s for s in self.logs if s < step - 4]:
            self.logs.pop(old, None)
            self.fields.pop(old, None)
        return field


# ---------------------------------------------------------------------------------------- step log

Raw = tuple[str, str, int, bool, bool, bool, str, Any, str, float, Any]


class StepLog:
    """What one step moved: the first ``COPY_CAP`` copies one by one, the rest aggregated."""

    __slots__ = ("copies", "groups", "more_count", "pinned_bytes", "pinned_calls", "timed")

    def __init__(self) -> None:
        self.copies: list[Raw] = []
        self.groups: dict[tuple[Any, ...], list[float]] = {}
        self.more_count = 0
        self.timed = 0
        self.pinned_bytes = 0
        self.pinned_calls = 0

    def add(self, raw: Raw) -> None:
        if len(self.copies) < COPY_CAP:
            self.copies.append(raw)
            return
        op, direction, nbytes, pinned, nb, sync, phase, where, _site, host_ms, _ = raw
        key = (direction, phase, where, pinned, nb, op)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = [0, 0, 0.0]
        group[0] += 1
        group[1] += nbytes
        group[2] += host_ms if sync else 0.0
        self.more_count += 1

    def to_field(self, device: Device) -> dict[str, Any]:
        copies = [_copy_row(raw, device) for raw in list(self.copies)]
        groups = [_group_row(k, v) for k, v in list(self.groups.items())]
        return {
            "h2d": _totals("h2d", copies, groups),
            "d2h": _totals("d2h", copies, groups),
            "sync_reads": sum(1 for c in copies if c["op"] in READ_OPS)
            + sum(g["count"] for g in groups if g["op"] in READ_OPS),
            "pinned_host": {"bytes": self.pinned_bytes, "calls": self.pinned_calls},
            "copies": copies,
            "more": {"count": self.more_count, "groups": groups},
        }


def _copy_row(raw: Raw, device: Device) -> dict[str, Any]:
    op, direction, nbytes, pinned, nb, sync, phase, where, site, host_ms, marks = raw
    device_ms = None
    if marks is not None:
        ms = device.resolve_ms(marks)
        device_ms = round(max(0.0, ms[1] - ms[0]), 4)
    return {
        "op": op,
        "dir": direction,
        "bytes": nbytes,
        "pinned": pinned,
        "non_blocking": nb,
        "sync": sync,
        "phase": phase,
        "model": where[0] if where else None,
        "module": where[1] if where else None,
        "site": site,
        "host_ms": round(host_ms, 4) if sync else None,
        "device_ms": device_ms,
    }


def _group_row(key: tuple[Any, ...], value: list[float]) -> dict[str, Any]:
    direction, phase, where, pinned, nb, op = key
    return {
        "op": op,
        "dir": direction,
        "phase": phase,
        "model": where[0] if where else None,
        "module": where[1] if where else None,
        "pinned": pinned,
        "non_blocking": nb,
        "count": int(value[0]),
        "bytes": int(value[1]),
        "host_ms": round(value[2], 4),
    }


def _totals(direction: str, copies: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [c for c in copies if c["dir"] == direction]
    more = [g for g in groups if g["dir"] == direction]
    timed = [c["device_ms"] for c in mine if c["device_ms"] is not None]
    return {
        "bytes": sum(c["bytes"] for c in mine) + sum(g["bytes"] for g in more),
        "copies": len(mine) + sum(g["count"] for g in more),
        "pageable_bytes": sum(c["bytes"] for c in mine if not c["pinned"])
        + sum(g["bytes"] for g in more if not g["pinned"]),
        "sync": sum(1 for c in mine if c["sync"]) + sum(g["count"] for g in more if not g["non_blocking"]),
        "host_ms": round(sum(c["host_ms"] or 0.0 for c in mine) + sum(g["host_ms"] for g in more), 4),
        "device_ms": round(sum(timed), 4) if timed else None,
        "untimed": sum(1 for c in mine if not c["sync"] and c["device_ms"] is None)
        + sum(g["count"] for g in more if g["non_blocking"]),
    }


def pcie_field(samples: list[tuple[float, int, int]]) -> dict[str, Any] | None:
    """The step's PCIe samples ``[t_ms, tx, rx]`` (bytes/s; t since profiling start) and their means."""
    if not samples:
        return None
    kept = samples[:PCIE_SAMPLES_CAP]
    n = len(samples)
    return {
        "samples": [[round(t, 1), tx, rx] for t, tx, rx in kept],
        "count": n,
        "tx_mean_bytes_per_s": int(sum(s[1] for s in samples) / n),
        "rx_mean_bytes_per_s": int(sum(s[2] for s in samples) / n),
        "tx_max_bytes_per_s": max(s[1] for s in samples),
        "rx_max_bytes_per_s": max(s[2] for s in samples),
    }


# ---------------------------------------------------------------------------------------- sampler


class PcieSampler(threading.Thread):
    """Reads the PCIe throughput counters every ``interval`` seconds until ``halt()``."""

    MAX_SAMPLES = 100_000
    MAX_FAILURES = 3

    def __init__(self, reader: Reader, interval: float, step: Callable[[], int]) -> None:
        # Not a daemon, so the test suite sees a sampler left running; it also ends by itself once the
        # main thread has (interpreter shutdown), so a missed stop() cannot hang the script's exit.
        super().__init__(name="memdoctor-pcie", daemon=False)
        self.reader, self.interval, self.step = reader, interval, step
        self.samples: list[tuple[float, int, int, int]] = []  # (perf_counter, step, tx, rx)
        self.stopped = threading.Event()

    def run(self) -> None:
        main, failures = threading.main_thread(), 0
        while not self.stopped.wait(self.interval) and main.is_alive():
            try:
                value = self.reader()
            except Exception:  # the sampler must never raise
                value = None
            if value is None:
                failures += 1
                if failures >= self.MAX_FAILURES:
                    return
                continue
            if len(self.samples) < self.MAX_SAMPLES:
                self.samples.append((time.perf_counter(), self.step(), int(value[0]), int(value[1])))

    def halt(self) -> None:
        self.stopped.set()

    def for_step(self, step: int, t0: float) -> list[tuple[float, int, int]]:
        return [((t - t0) * 1000.0, tx, rx) for t, s, tx, rx in list(self.samples) if s == step]


# ---------------------------------------------------------------------------------------- wrappers


def _wrap_to(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy():
            return orig(self, *args, **kwargs)
        target = _target(args, kwargs, accel)
        direction = _direction(self.device.type, target, accel) if target is not None else None
        if direction is None:
            return orig(self, *args, **kwargs)
        host = self if direction == "h2d" else None
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("to", direction, host, int(self.nbytes), nb, orig, (self, *args), kwargs)

    return to


def _wrap_cuda(col: TransferCollector, orig: Any, name: str) -> Any:
    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or self.device.type != "cpu":
            return orig(self, *args, **kwargs)
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("cuda", "h2d", self, int(self.nbytes), nb, orig, (self, *args), kwargs)

    return cuda


def _wrap_cpu(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or self.device.type != accel:
            return orig(self, *args, **kwargs)
        return col.transfer("cpu", "d2h", None, int(self.nbytes), False, orig, (self, *args), kwargs)

    return cpu


def _wrap_copy(col: TransferCollector, orig: Any, name: str) -> Any:
    accel = col.accel

    def copy_(self: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy() or not isinstance(src, torch.Tensor):
            return orig(self, src, *args, **kwargs)
        direction = _direction(src.device.type, self.device.type, accel)
        if direction is None:
            return orig(self, src, *args, **kwargs)
        host = src if direction == "h2d" else self
        nb = _flag(args, kwargs, "non_blocking")
        return col.transfer("copy_", direction, host, int(src.nbytes), nb, orig, (self, src, *args), kwargs)

    return copy_


def _wrap_read(col: TransferCollector, orig: Any, name: str) -> Any:
    """``.item()``, ``.tolist()``, ``bool()``, ...: a synchronous device-to-host read."""
    accel = col.accel
    op = name.strip("_")

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (
            _compiling()
            or col.busy()
            or self.device.type != accel
            or (name == "numpy" and not _flag(args, kwargs, "force"))
        ):
            return orig(self, *args, **kwargs)
        nbytes = int(self.element_size()) if name != "tolist" else int(self.nbytes)
        return col.transfer(op, "d2h", None, nbytes, False, orig, (self, *args), kwargs)

    read.__name__ = name
    return read


def _wrap_pin(col: TransferCollector, orig: Any, name: str) -> Any:
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or col.busy():
            return orig(self, *args, **kwargs)
        return col.pin(orig, self, args, kwargs)

    return pin_memory


def _wrap_factory(col: TransferCollector, orig: Any, name: str) -> Any:
    """``torch.tensor(data, device=...)`` / ``torch.as_tensor``: a host-to-device copy of the result."""
    accel = col.accel

    def factory(data: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if _compiling() or col.busy() or device is None or _device_type(device, accel) != accel:
            return orig(data, *args, **kwargs)
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return orig(data, *args, **kwargs)  # no host side: already on a device
        return col.transfer(name, "h2d", None, -1, False, orig, (data, *args), kwargs)

    factory.__name__ = name
    return factory


_TENSOR_WRAPPERS: dict[str, Callable[..., Any]] = {
    "to": _wrap_to,
    "cuda": _wrap_cuda,
    "cpu": _wrap_cpu,
    "copy_": _wrap_copy,
    "pin_memory": _wrap_pin,
    **dict.fromkeys(READS, _wrap_read),
}


# ---------------------------------------------------------------------------------------- helpers


def _target(args: tuple[Any, ...], kwargs: dict[str, Any], accel: str) -> str | None:
    """The device type ``Tensor.to(...)`` moves to, or None for a dtype/memory-format change only."""
    if "device" in kwargs:
        return _device_type(kwargs["device"], accel)
    if not args:
        return None
    first = args[0]
    if isinstance(first, torch.Tensor):
        return first.device.type
    return _device_type(first, accel)


def _device_type(value: Any, accel: str) -> str | None:
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        return value.partition(":")[0]
    if isinstance(value, int) and not isinstance(value, bool):
        return accel  # a bare index names an accelerator
    return None


def _direction(src: str, dst: str | None, accel: str) -> str | None:
    if src == "cpu" and dst == accel:
        return "h2d"
    if src == accel and dst == "cpu":
        return "d2h"
    return None


def _flag(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> bool:
    """A boolean option given by keyword, or as the first positional bool (``to(dev, dtype, True)``)."""
    if name in kwargs:
        return bool(kwargs[name])
    return next((a for a in args if isinstance(a, bool)), False)


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return t.device.type == "cpu" and bool(t.is_pinned())
    except RuntimeError:  # a torch built without an accelerator cannot tell: no tensor is pinned there
        return False


def _site() -> str | None:
    """``dir/file.py:line`` of the first caller outside torch and this module; None for memdoctor's own
    calls (its figures read back in ``step_field``), which are not the script's transfers."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        glb = frame.f_globals
        if glb is _HERE:
            frame = frame.f_back
            continue
        mod = glb.get("__name__") or ""
        if mod == "torch" or mod.startswith("torch."):
            frame = frame.f_back
            continue
        if mod == "memdoctor" or mod.startswith("memdoctor."):
            return None
        path = frame.f_code.co_filename
        return f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{frame.f_lineno}"
    return "?"
