"""The what-if model: the peak memory and the step time of a training step under a changed config,
calibrated from what one trace measured.

``workload`` is what the planner plans from (``memdoctor.plan.workload``: the measured peak split by the
levers that act on it); a ``Config`` (``memdoctor.plan.config``) changes some of its parts; ``predict``
returns the new peak (``memdoctor.plan.memory``) and step time (``memdoctor.plan.timing``) with the
assumptions they rest on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memdoctor.plan.candidates import shard_blocks
from memdoctor.plan.config import EXPANDABLE_SEGMENTS, Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.memory import (
    EXPANDABLE_GAP_KEPT,
    memory_parts,
    outermost,
    ranks,
    reserved_ratio,
)
from memdoctor.plan.parallel import engine_floor, engine_parts, from_rank
from memdoctor.plan.reprofiled import reprofiled_workload
from memdoctor.plan.timing import Link, time_model
from memdoctor.plan.workload import Workload
from memdoctor.trace import Trace


@dataclass
class Prediction:
    """The predicted peak and step time of one config, with what the prediction assumes."""

    config: Config
    peak_bytes: int  # allocated
    reserved_bytes: int  # what the card must hold: allocated x the measured reserved ratio
    breakdown: dict[str, int]
    extra_ms: float | None  # added to the measured step time (negative: faster)
    time_ratio: float | None  # predicted / measured step time; None when the step time is unknown
    time_parts: dict[str, float | None]
    assumptions: list[str]
    time_basis: dict[str, str] = field(default_factory=dict)  # per time part: what its figure rests on

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.as_dict(),
            "predicted_peak_bytes": self.peak_bytes,
            "predicted_reserved_bytes": self.reserved_bytes,
            "breakdown": dict(self.breakdown),
            "predicted_step_time_ratio": _round(self.time_ratio),
            "predicted_extra_ms": _round(self.extra_ms),
            "time_parts": {k: _round(v) for k, v in self.time_parts.items()},
            "time_basis": dict(self.time_basis),
            "assumptions": list(self.assumptions),
        }


def workload(trace: Trace, summary: dict[str, Any]) -> Workload | None:
    """What the planner plans from: the trace's own measurements (``measured_workload``) or, when the run
    died before its first forward finished and ``memdoctor profile`` re-profiled it at a smaller
    micro-batch, that measurement scaled back to the full batch (``memdoctor.plan.reprofiled``). A rank's
    trace (several GPUs) is planned from its one-process equivalent (``memdoctor.plan.parallel``)."""
    w = reprofiled_workload(trace) or measured_workload(trace, summary)
    if w is not None and w.shard_units and not w.shard_names:  # a re-profile recorded before names
        names, units = shard_blocks(trace)
        w = dataclasses.replace(w, shard_names=names) if units == w.shard_units else w
    return None if w is None else from_rank(w, trace, summary)


def predict(
    w: Workload,
    config: Config,
    *,
    bf16: bool | None = None,
    offload_bytes_per_s: float | None = None,
    card_name: str | None = None,
) -> Prediction:
    """The peak and time of ``config``. ``bf16``: whether the target card has native bf16 (default: the
    profiled device's); ``offload_bytes_per_s``: the target's host link (default: the measured one);
    ``card_name``: the target card, for its datasheet 16-bit speed-up (default: the profiled GPU)."""
    assumptions = list(w.notes)
    chosen = outermost([c for c in w.candidates if c.name in set(config.checkpoint)])
    parts = engine_parts(w, config, memory_parts(w, config, chosen, assumptions), assumptions)
    allocated = sum(parts.values())
    floor = engine_floor(w, config, parts, assumptions)
    if config != Config():
        same_shape = ranks(config) > 1 and config.accumulation_steps == 1 and not config.full_offload
        if not (chosen and config.accumulation_steps == 1) and not same_shape:
            assumptions.append(
                "gradients counted in full alongside the remaining activations (they are, from the "
                "second micro-batch on)"
            )
        allocated = max(allocated, floor)
    ratio = reserved_ratio(w, config)
    if ratio > w.reserved_ratio:
        assumptions.append(
            f"reserved memory = allocated x {ratio:.3f}: the allocator slack of a changed config, "
            f"calibrated on the GPU (measured {w.reserved_ratio:.3f} as profiled)"
        )
    elif ratio > 1.0:
        assumptions.append(f"reserved memory = allocated x {ratio:.3f}, the measured ratio at the peak")
    if config.allocator == EXPANDABLE_SEGMENTS and w.reserved_ratio > 1.0:
        assumptions[-1] = (
            f"expandable_segments assumed to keep {EXPANDABLE_GAP_KEPT:.0%} of the measured reserved - "
            f"allocated gap: reserved = allocated x {ratio:.3f} instead of the measured "
            f"{w.reserved_ratio:.3f} (an assumption)"
        )
    basis: dict[str, str] = {}
    time_parts = time_model(w, config, chosen, Link(bf16, offload_bytes_per_s, card_name), assumptions, basis)
    known = [v for v in time_parts.values() if v is not None]
    extra = None if len(known) < len(time_parts) else sum(known)
    step_ratio = (w.step_ms + extra) / w.step_ms if extra is not None and w.step_ms else None
    return Prediction(
        config,
        allocated,
        int(allocated * ratio),
        parts,
        extra,
        step_ratio,
        time_parts,
        assumptions,
        basis,
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
