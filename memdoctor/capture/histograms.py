"""Activation and gradient histograms: how each layer's values sit against fp16's and bf16's range.

For every timed module call of a detailed step, and for the gradient flowing back into that call's
output (``bwd_pre``), the collector records

* the exact minimum and maximum of the whole tensor (``torch.aminmax``: one kernel, a scalar result,
  written into a preallocated slot), from which the absolute max follows;
* a bounded strided sample of the tensor (at most ``SAMPLE_SIZE`` values), copied into a row of a
  preallocated float32 device buffer (one kernel, no allocation proportional to the tensor).

That is two kernel launches per module call, no host synchronisation, and no reference kept to the
module's output (the memory ledger would otherwise see it live longer). Everything else — the
histogram of floor(log2|x|) per row, the fp16 overflow count — is computed from the sample rows in a
few batched kernels and read to the host once per step, in ``step_field``, after the step's GPU work.

Which tensor: of a module's output, the first floating-point tensor that takes part in autograd (the
one the session's backward hook watches, so forward and backward describe the same tensor), else the
first floating-point tensor; for a tuple or dict output the others are left out. Only the first call
of each module in a step is measured (the first micro-batch, the first use of a module called twice).
Gradients are recorded as autograd hands them over: under fp16 with a ``GradScaler`` they are
multiplied by the loss scale, and the trace records each tensor's dtype so a reader can say so.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.capture.collectors import Collector
from memdoctor.capture.histsample import (
    DTYPE_NAMES,
    DTYPES,
    EXP_BINS,
    FP16_MAX,
    LOG2_MAX,
    LOG2_MIN,
    SAMPLE_SIZE,
    DeviceRows,
    Row,
    copy_sample,
    device_stats,
    first_float,
)

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession
    from memdoctor.device import Device

KEEP_STEPS = 4  # steps whose results stay cached for their final record
MAX_ROWS = 1024  # per step; calls beyond it are counted as skipped, not measured
DIRECTIONS = ("forward", "backward")
# The columns of one direction's entries in the trace (docs/trace-format.md, collectors.histograms).
ENTRY_KEYS = (
    *("module", "dtype", "numel", "sampled", "abs_max", "nonfinite_any"),
    *("zero", "nonfinite", "overflow", "log2_lo", "counts"),
)


class HistogramCollector(Collector):
    """log2|x| histograms, absolute max and fp16 range fractions of module outputs and their gradients."""

    name = "histograms"
    wants_modules = True

    def __init__(self, device: Device | None = None, **_: Any) -> None:
        self._session: ProfileSession | None = None
        self._devices: dict[torch.device, DeviceRows] = {}
        self._open = False
        self._step = -1
        self._batch_step = -1  # the step the rows in the buffers belong to
        self._seen: set[tuple[int, int]] = set()  # (key, direction) measured in this batch
        self._skipped = 0
        self._results: dict[int, dict[str, Any] | None] = {}

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self, session: ProfileSession) -> None:
        self._session = session
        session.emit(self.name, describe())

    def stop(self) -> None:
        self._open = False
        self._devices.clear()  # frees the device buffers

    def on_step_start(self, step: int, detailed: bool) -> None:
        self._step, self._open = step, detailed

    def on_optimizer_end(self, step: int) -> None:
        # The step's forward and backward are over: later tensors are not this step's.
        self._open = False

    # ---------------------------------------------------------------------------------- hot path
    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        if timed and self._open:
            tensor = first_float(output)
            if tensor is not None:
                self._record(key, 0, tensor)

    def on_backward(self, event: str, key: int, depth: int, grad: Any) -> None:
        if event == "bwd_pre" and self._open and isinstance(grad, torch.Tensor):
            self._record(key, 1, grad)

    def _record(self, key: int, direction: int, tensor: torch.Tensor) -> None:
        """Two launches: aminmax into the row's slots, the strided sample into its buffer row."""
        if tensor.dtype not in DTYPES or tensor.layout != torch.strided or tensor.is_meta:
            return
        if self._batch_step != self._step:
            self._new_batch()
        n = tensor.numel()
        if n == 0 or (key, direction) in self._seen:
            return
        rows = self._devices.get(tensor.device) or self._devices.setdefault(
            tensor.device, DeviceRows(tensor.device)
        )
        if self._total_rows() >= MAX_ROWS:
            self._skipped += 1
            return
        self._seen.add((key, direction))
        x = tensor.detach()  # a view: no copy, and no autograd graph through our buffers
        try:
            sample_row, lo, hi = rows.slot(x.dtype)
            torch.aminmax(x, out=(lo, hi))
            k = copy_sample(x, sample_row)
        except (RuntimeError, TypeError, NotImplementedError):
            # A tensor subclass or backend without these ops: skip this tensor, keep measuring others.
            self._skipped += 1
            return
        rows.rows.append(Row(key, direction, x.dtype, n, k))

    def _new_batch(self) -> None:
        """A new step's first tensor: the old rows were read already, or no record wants them."""
        for rows in self._devices.values():
            rows.rows.clear()
        self._seen.clear()
        self._skipped = 0
        self._batch_step = self._step

    def _total_rows(self) -> int:
        return sum(len(r.rows) for r in self._devices.values())

    # ---------------------------------------------------------------------------------- per step
    def step_field(self, step: int) -> Any:
        """The step's histograms (computed and read to the host here, once; cached for a second call)."""
        if step not in self._results:
            if self._batch_step != step or not any(r.rows for r in self._devices.values()):
                return None
            self._results[step] = self._read(step)
            for old in [s for s in self._results if s < step - KEEP_STEPS]:
                del self._results[old]  # a final record comes at most a few steps after its provisional
        return self._results[step]

    def module_columns(self, step: int) -> dict[int, dict[str, list[Any]]]:
        data = self._results.get(step)
        if not data or self._session is None:
            return {}
        sizes = {int(m): self._session.module_count(int(m)) for m in data["models"]}
        return module_fractions(data, sizes)

    def _read(self, step: int) -> dict[str, Any] | None:
        """Batched statistics of every row, one read to the host, grouped per model and direction."""
        per_row: list[tuple[Row, list[float]]] = []
        for rows in self._devices.values():
            if rows.rows:
                per_row += zip(rows.rows, device_stats(rows), strict=True)
        field_ = self._group(per_row)
        for rows in self._devices.values():
            rows.rows.clear()
        return field_

    def _group(self, per_row: list[tuple[Row, list[float]]]) -> dict[str, Any] | None:
        assert self._session is not None
        models: dict[str, dict[str, dict[str, list[Any]]]] = {}
        for row, stats in per_row:
            loc = self._session.locate(row.key)
            if loc is None:  # not a module of a trained model (a loss module, say)
                continue
            model = models.setdefault(str(loc[0]), {})
            cols = model.setdefault(DIRECTIONS[row.direction], _empty_columns())
            _append(cols, loc[1], row, stats)
        if not models:
            return None
        return {"models": models, "skipped_calls": self._skipped}


# -------------------------------------------------------------------------------------- trace layout


def describe() -> dict[str, Any]:
    """The run-wide ``collector`` record: how the histograms were taken."""
    return {
        "sample_size": SAMPLE_SIZE,
        "log2_min": LOG2_MIN,
        "log2_max": LOG2_MAX,
        "fp16_max": FP16_MAX,
        "tensor": "first floating-point output tensor that requires grad (else the first); "
        "backward: the gradient of that tensor",
        "calls": "the first call of each module in a step",
    }


def _empty_columns() -> dict[str, list[Any]]:
    return {k: [] for k in ENTRY_KEYS}


def _append(cols: dict[str, list[Any]], module: int, row: Row, stats: list[float]) -> None:
    """One measured tensor's entry: counts trimmed to the exponents that occur (``log2_lo`` first)."""
    abs_max, overflow, counts = stats[0], stats[1], [int(c) for c in stats[2:]]
    zero, exps, nonfinite = counts[0], counts[1 : EXP_BINS + 1], counts[EXP_BINS + 1]
    used = [i for i, c in enumerate(exps) if c]
    lo, hi = (used[0], used[-1] + 1) if used else (0, 0)
    finite_max = math.isfinite(abs_max)
    cols["module"].append(module)
    cols["dtype"].append(DTYPE_NAMES.get(row.dtype, str(row.dtype)))
    cols["numel"].append(row.numel)
    cols["sampled"].append(row.sampled)
    cols["abs_max"].append(float(f"{abs_max:.6g}") if finite_max else None)
    cols["nonfinite_any"].append(not finite_max)
    cols["zero"].append(zero)
    cols["nonfinite"].append(nonfinite)
    cols["overflow"].append(int(overflow))
    cols["log2_lo"].append(LOG2_MIN + lo)
    cols["counts"].append(exps[lo:hi])


def fractions(cols: dict[str, list[Any]], i: int) -> dict[str, float]:
    """Entry ``i``'s fractions of its sample: fp16 overflow (|x| > 65504 or inf), subnormal
    (0 < |x| < 2**-14), flushed to zero by fp16 (0 < |x| < 2**-24) and non-finite."""
    n = cols["sampled"][i] or 1
    lo, counts = cols["log2_lo"][i], cols["counts"][i]
    return {
        "overflow": cols["overflow"][i] / n,
        "underflow": count_below(lo, counts, -14) / n,
        "flush": count_below(lo, counts, -24) / n,
        "nonfinite": cols["nonfinite"][i] / n,
    }


def count_below(lo: int, counts: list[int], log2: int) -> int:
    """Sampled non-zero values with |x| < 2**log2, from counts that start at exponent ``lo``."""
    return sum(c for k, c in enumerate(counts) if lo + k < log2)


_COLUMNS = {
    ("forward", "overflow"): "fp16_overflow_fraction",
    ("forward", "underflow"): "fp16_underflow_fraction",
    ("backward", "overflow"): "grad_fp16_overflow_fraction",
    ("backward", "underflow"): "grad_fp16_underflow_fraction",
}


def module_fractions(data: dict[str, Any], sizes: dict[int, int]) -> dict[int, dict[str, list[Any]]]:
    """The step's per-module columns: fp16 overflow and underflow fractions of outputs and gradients."""
    out: dict[int, dict[str, list[Any]]] = {}
    for key, model in data["models"].items():
        n = sizes.get(int(key), 0)
        if not n:
            continue
        cols = out[int(key)] = {name: [None] * n for name in _COLUMNS.values()}
        for direction, entries in model.items():
            for i, module in enumerate(entries["module"]):
                if 0 <= module < n:
                    for what, value in fractions(entries, i).items():
                        name = _COLUMNS.get((direction, what))
                        if name:
                            cols[name][module] = float(f"{value:.6g}")
    return out
