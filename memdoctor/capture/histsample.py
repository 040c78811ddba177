"""Sampling a tensor into preallocated device rows, and the statistics of those rows, for
``HistogramCollector`` (``histograms.py`` says what is measured and why).

Everything here runs on the device and never reads a value back: a hook copies a strided sample of
the tensor into its row and records its min and max; ``device_stats`` turns all rows of a step into
the bins and fractions in a few batched kernels, read back once when the step's record is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLE_SIZE = 4096  # values sampled per tensor; the fractions come from this sample
LOG2_MIN = -48  # bin LOG2_MIN holds every non-zero |x| < 2**(LOG2_MIN + 1)
LOG2_MAX = 47  # bin LOG2_MAX holds every finite |x| >= 2**LOG2_MAX
EXP_BINS = LOG2_MAX - LOG2_MIN + 1
# Device-side bin layout: 0 zero, 1..EXP_BINS the exponents, then non-finite, then unused (padding).
_NONFINITE_BIN = EXP_BINS + 1
_PAD_BIN = EXP_BINS + 2
FP16_MAX = 65504.0
CHUNK_ROWS = 32  # sample-buffer rows allocated at a time (32 x 4096 float32 = 512 KiB)
# aminmax supports these; other floating types (float8) are skipped rather than failing in a hook.
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPE_NAMES[torch.float64] = "float64"


@dataclass
class Row:
    """One measured tensor: whose, which direction, how it was sampled."""

    key: int
    direction: int  # index into DIRECTIONS
    dtype: torch.dtype
    numel: int
    sampled: int


_Views = list[torch.Tensor]


@dataclass
class DeviceRows:
    """Preallocated rows on one device: float32 samples and, per dtype, the (min, max) slots.

    The per-row views are made once, when a chunk is allocated, so the hot path only indexes lists."""

    device: torch.device
    samples: list[torch.Tensor] = field(default_factory=list)  # CHUNK_ROWS x SAMPLE_SIZE each
    minmax: dict[torch.dtype, list[torch.Tensor]] = field(default_factory=dict)  # 2 x CHUNK_ROWS each
    rows: list[Row] = field(default_factory=list)
    _sample_views: list[torch.Tensor] = field(default_factory=list)
    _slot_views: dict[torch.dtype, tuple[_Views, _Views]] = field(default_factory=dict)  # (mins, maxs)

    def slot(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next free row: its sample row and its min and max slots (allocated on first use only)."""
        i = len(self.rows)
        while len(self._sample_views) <= i:
            chunk = torch.zeros(CHUNK_ROWS, SAMPLE_SIZE, device=self.device)
            self.samples.append(chunk)
            self._sample_views += chunk.unbind(0)
        lows, highs = self._slot_views.setdefault(dtype, ([], []))
        while len(lows) <= i:
            mm = torch.zeros(2, CHUNK_ROWS, dtype=dtype, device=self.device)
            self.minmax.setdefault(dtype, []).append(mm)
            lows += mm[0].unbind(0)
            highs += mm[1].unbind(0)
        return self._sample_views[i], lows[i], highs[i]


def first_float(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first floating tensor of an output that takes part in autograd, else the first at all."""
    found: list[torch.Tensor] = []
    _floats(obj, depth, found)
    for t in found:
        if t.requires_grad:
            return t
    return found[0] if found else None


def _floats(obj: Any, depth: int, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            found.append(obj)
        return
    if depth > 2 or len(found) > 8:
        return
    items: Any = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        _floats(item, depth + 1, found)


def copy_sample(x: torch.Tensor, row: torch.Tensor) -> int:
    """Copy at most ``len(row)`` values of ``x``, spread over the whole tensor, into ``row`` (one
    kernel: a strided read with the dtype conversion to float32); return how many."""
    n, size = x.numel(), row.numel()
    if x.is_contiguous():
        step = _coprime_step(-(-n // size), x.shape[-1] if x.dim() else 1)
        k = -(-n // step)
        row[:k].copy_(x.view(-1)[::step])
        return k
    view = x[tuple(slice(None, None, s) for s in _dim_steps(tuple(x.shape), size))]
    k = view.numel()
    row[:k].view(view.shape).copy_(view)
    return k


def _coprime_step(step: int, last_dim: int) -> int:
    """The smallest stride >= ``step`` that shares no factor with the innermost dimension, so that a
    sample of a (batch, sequence, hidden) tensor covers every hidden channel instead of a few."""
    while step > 1 and math.gcd(step, last_dim) != 1:
        step += 1
    return step


def _dim_steps(shape: tuple[int, ...], budget: int) -> list[int]:
    """Per-dimension strides for a non-contiguous tensor: each dimension gets a fair share of the
    budget (a small one is taken whole and leaves more to the others); the product stays <= budget."""
    steps: list[int] = []
    left = budget
    for i, size in enumerate(shape):
        share = max(1, int(left ** (1.0 / (len(shape) - i)) + 1e-9))
        step = -(-size // min(size, share)) if size else 1
        steps.append(step)
        left = max(1, left // max(1, -(-size // step)))
    return steps


# -------------------------------------------------------------------------------------- statistics


def device_stats(rows: DeviceRows) -> list[list[float]]:
    """Per row: ``[abs_max, overflow, counts per bin (zero, exponents, non-finite)]`` as floats.

    A few kernels per 32-row chunk (|x|, log2, floor, the bin index, a scatter-add, the overflow
    count), all results concatenated and read with one copy to the host: the step's only sync."""
    parts: list[torch.Tensor] = []
    lengths = [r.sampled for r in rows.rows]
    for c, chunk in enumerate(rows.samples):
        mine = lengths[c * CHUNK_ROWS : (c + 1) * CHUNK_ROWS]
        if not mine:
            break
        width = max(mine)  # only the columns some row of this chunk uses
        valid = torch.arange(width, device=rows.device) < _host_list(mine, rows.device)[:, None]
        parts.append(_chunk_stats(chunk[: len(mine), :width], valid, _abs_max(rows, c, len(mine))))
    host = torch.cat(parts).to(torch.float64).cpu()
    return host.tolist()


def _host_list(values: list[Any], device: torch.device) -> torch.Tensor:
    """A small host list on the device without a sync: ``torch.tensor(values, device=cuda)`` copies from
    pageable memory, which waits for the GPU (``set_sync_debug_mode`` flags it); a pinned copy is queued."""
    host = torch.tensor(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _abs_max(rows: DeviceRows, chunk: int, m: int) -> torch.Tensor:
    """Each row's exact absolute max from the (min, max) slot of its dtype (NaN when it holds a NaN)."""
    out = torch.zeros(m, dtype=torch.float64, device=rows.device)
    dtypes = [r.dtype for r in rows.rows[chunk * CHUNK_ROWS : chunk * CHUNK_ROWS + m]]
    for dtype, slots in rows.minmax.items():
        if chunk >= len(slots) or dtype not in dtypes:
            continue
        mine = _host_list([d == dtype for d in dtypes], rows.device)
        mm = slots[chunk][:, :m].to(torch.float64)
        out = torch.where(mine, torch.maximum(-mm[0], mm[1]), out)
    return out


def _chunk_stats(sample: torch.Tensor, valid: torch.Tensor, abs_max: torch.Tensor) -> torch.Tensor:
    a = sample.abs()
    finite = torch.isfinite(a)
    exp = torch.log2(a).floor_().clamp_(LOG2_MIN, LOG2_MAX) - (LOG2_MIN - 1)  # 1..EXP_BINS
    idx = torch.where(a == 0, torch.zeros_like(exp), exp)
    idx = torch.where(finite, idx, torch.full_like(exp, _NONFINITE_BIN))
    idx = torch.where(valid, idx, torch.full_like(exp, _PAD_BIN)).long()
    counts = torch.zeros(a.shape[0], _PAD_BIN + 1, dtype=torch.int64, device=a.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx))
    overflow = ((a > FP16_MAX) & valid).sum(1, keepdim=True)  # inf included, NaN not
    return torch.cat(
        [abs_max[:, None], overflow.to(torch.float64), counts[:, :_PAD_BIN].to(torch.float64)], 1
    )
