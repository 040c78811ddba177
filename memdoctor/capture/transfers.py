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
would feel as a slowdown of several times; the profiler aims at 1.5x at most (BENCHMARKS.md,
overhead). Copies made inside C++ (a ``DataParallel`` scatter, NCCL) are not seen by the wrappers; the
PCIe counters below still see their bytes.

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
from memdoctor.capture import transferwraps
from memdoctor.capture.collectors import Collector, CollectorUnavailable
from memdoctor.capture.transferlog import COPY_CAP, READ_OPS, PcieSampler, Reader, StepLog, pcie_field
from memdoctor.device import Device, nvml

__all__ = ["COPY_CAP", "TransferCollector"]

TIMED_CAP = 64  # non-blocking copies per step that get a device-marker pair
SAMPLE_INTERVAL_S = 0.1
# The modules whose frames ``_site`` steps over: the collector's and its wrappers'.
_OWN = frozenset({__name__, transferwraps.__name__})


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
        for name, make in transferwraps.TENSOR_WRAPPERS.items():
            self._patch(tensor, name, make)
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, transferwraps.wrap_factory)

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
        mod = frame.f_globals.get("__name__") or ""
        if mod in _OWN:
            frame = frame.f_back
            continue
        if mod == "torch" or mod.startswith("torch."):
            frame = frame.f_back
            continue
        if mod == "memdoctor" or mod.startswith("memdoctor."):
            return None
        path = frame.f_code.co_filename
        return f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{frame.f_lineno}"
    return "?"
