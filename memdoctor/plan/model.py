"""The what-if model: the peak memory and the step time of a training step under a changed config,
calibrated from what one trace measured.

The measured peak is split into what each lever acts on (``Workload``): parameters, gradients,
optimizer state, activations (what the modules saved for backward), temporaries (the peak ledger's
allocations by code site), and a fixed rest (workspaces, allocator slack). A ``Config`` changes some of
them; ``predict`` returns the new peak with the assumptions it rests on. The unchanged config predicts
exactly the measured peak (the calibration point). Every factor that is an assumption rather than a
measurement is a named constant here, listed in ``docs/planner.md``, to be calibrated on the GPU by
``benchmarks/plan_accuracy.py``.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from memdoctor.analysis.summary import layer_table, peak_step, repeated_blocks
from memdoctor.trace import Trace

# Autocast (bf16/fp16): activations saved by matmul-type modules and the elementwise ops that consume
# their outputs are stored in 16 bits, half of fp32; other modules (LayerNorm, softmax in fp32, embeddings)
# keep fp32. An assumption to calibrate.
AMP_ACTIVATION_FACTOR = 0.5
AMP_HALVING_TYPES = re.compile(r"Linear|Conv|Attention|GELU|ReLU|SiLU|Tanh|Sigmoid|Mish|MLP", re.I)
# Autocast caches a 16-bit copy of each matmul weight for the forward: + half the fp32 weight bytes.
AMP_WEIGHT_CACHE_FACTOR = 0.5
# 8-bit Adam-style optimizers (bitsandbytes) keep the two moments in 8 bits instead of 32: state / 4.
EIGHT_BIT_STATE_FACTOR = 0.25
# Assumed optimizer state when the run died before its first optimizer step: AdamW's two fp32 moments.
ASSUMED_ADAM_STATE_FACTOR = 2.0
# Time: the share of forward+backward time that does not shrink with a smaller micro-batch (kernel
# launches, fixed-size work), by the measured compute class; "unknown" when compute was not measured.
# Without a compute measurement the cost is unknown (and said so) rather than guessed.
ACCUMULATION_FIXED_SHARE: dict[str | None, float] = {"high": 0.05, "medium": 0.15, "low": 0.3}
# Time: forward+backward under autocast as a fraction of fp32, with tensor cores for the dtype.
AMP_TIME_FACTOR = {"high": 0.6, "medium": 0.8, "low": 0.95, None: 0.8}
MIN_CANDIDATE_BYTES = 1024**2  # modules freeing less are not worth a checkpoint wrapper
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("as-is", "8bit", "offload")


@dataclass(frozen=True)
class Candidate:
    """A module that could be checkpointed: what it frees and what recomputing it costs."""

    name: str
    model: int
    index: int
    depth: int
    free_bytes: int
    forward_ms: float
    ancestors: frozenset[tuple[int, int]]

    @property
    def key(self) -> tuple[int, int]:
        return (self.model, self.index)

    @property
    def bytes_per_ms(self) -> float:
        return self.free_bytes / max(self.forward_ms, 1e-3)


@dataclass
class Workload:
    """What one trace measured, split by the levers that act on it."""

    peak_bytes: int
    reserved_ratio: float  # max reserved / max allocated at the peak step (allocator slack), >= 1
    parameters: int
    gradients_at_peak: int
    gradients: int  # all gradients allocated (measured before the optimizer step)
    optimizer_state: int
    activations: int  # at the peak
    temporaries: int  # the peak ledger's temporaries: scale with the micro-batch
    fixed: int  # the rest of the peak: workspaces, allocator slack, unattributed
    amp_share: float  # share of the saved activations that autocast stores in 16 bits
    matmul_param_bytes: int
    step_ms: float | None
    fwd_bwd_ms: float | None
    compute_class: str | None
    batch_size: int | None
    complete: bool  # the peak step finished (not cut short by an OOM)
    candidates: list[Candidate]
    offload_bytes_per_s: float | None  # measured pinned host<->device rate
    bf16_native: bool | None  # of the profiled device
    precision_verdict: str | None
    notes: list[str] = field(default_factory=list)  # measured gaps and assumptions of the calibration


@dataclass(frozen=True)
class Config:
    """A what-if: the levers applied on top of the profiled run (which is ``Config()``)."""

    checkpoint: tuple[str, ...] = ()  # module names, none nested in another
    accumulation: int = 1  # micro-batches per step: the micro-batch is the measured batch / accumulation
    precision: str = "fp32"  # "fp32" (as profiled), "bf16" or "fp16" autocast
    optimizer: str = "as-is"  # "as-is", "8bit" (8-bit optimizer state), "offload" (state on the CPU)

    def levers(self) -> list[str]:
        out = [f"checkpoint {len(self.checkpoint)} modules"] if self.checkpoint else []
        if self.accumulation > 1:
            out.append(
                f"micro-batch 1/{self.accumulation} with {self.accumulation}-step gradient accumulation"
            )
        if self.precision != "fp32":
            out.append(f"{self.precision} autocast")
        if self.optimizer == "8bit":
            out.append("8-bit optimizer")
        elif self.optimizer == "offload":
            out.append("optimizer state offloaded to the CPU")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": list(self.checkpoint),
            "accumulation_steps": self.accumulation,
            "precision": self.precision,
            "optimizer": self.optimizer,
        }


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.as_dict(),
            "predicted_peak_bytes": self.peak_bytes,
            "predicted_reserved_bytes": self.reserved_bytes,
            "breakdown": dict(self.breakdown),
            "predicted_step_time_ratio": _round(self.time_ratio),
            "predicted_extra_ms": _round(self.extra_ms),
            "time_parts": {k: _round(v) for k, v in self.time_parts.items()},
            "assumptions": list(self.assumptions),
        }


# ----------------------------------------------------------------------------------------- calibration


def workload(trace: Trace, summary: dict[str, Any]) -> Workload | None:
    """The trace's measurements as a ``Workload``; None when no step has a memory figure."""
    cats = summary.get("categories") or {}
    peak = summary.get("peak_memory_bytes")
    if not peak or cats.get("activations") is None or cats.get("parameters") is None:
        return None
    rows = layer_table(trace, peak_step(trace))
    notes: list[str] = []
    params = sum(r["param_bytes"] for r in rows)
    grads, opt = _state(rows, params, notes)
    accounted = sum(
        int(cats.get(c) or 0) for c in ("parameters", "gradients", "optimizer_state", "activations")
    )
    rest = max(0, int(peak) - accounted)
    temporaries = _temporaries(summary, rest, notes)
    complete = not summary.get("peak_from_incomplete_step")
    cands = candidates(trace, rows)
    missing = 0
    if not complete:
        missing, extra = extrapolate_blocks(trace, rows, notes)
        cands += extra
    return Workload(
        peak_bytes=int(peak),
        reserved_ratio=_reserved_ratio(trace, summary),
        parameters=int(cats.get("parameters") or params),
        gradients_at_peak=int(cats.get("gradients") or 0),
        gradients=grads,
        optimizer_state=max(opt, int(cats.get("optimizer_state") or 0)),
        activations=int(cats["activations"]) + missing,
        temporaries=temporaries,
        fixed=rest - temporaries,
        amp_share=_amp_share(rows),
        matmul_param_bytes=sum(r["param_bytes"] for r in rows if AMP_HALVING_TYPES.search(r["type"] or "")),
        step_ms=_step_ms(summary),
        fwd_bwd_ms=_fwd_bwd_ms(summary),
        compute_class=(summary.get("compute") or {}).get("class"),
        batch_size=_batch_size(summary),
        complete=complete,
        candidates=cands,
        offload_bytes_per_s=_offload_rate(summary),
        bf16_native=(summary.get("device") or {}).get("bf16_native"),
        precision_verdict=(summary.get("precision") or {}).get("verdict"),
        notes=notes,
    )


def _state(rows: list[dict[str, Any]], params: int, notes: list[str]) -> tuple[int, int]:
    """All gradients and optimizer state, from the per-module columns; assumed when never measured."""
    grads = sum(r["grad_bytes"] or 0 for r in rows)
    opt = sum(r["optimizer_state_bytes"] or 0 for r in rows)
    if grads == 0:
        grads = params
        notes.append("gradients not measured (no backward finished): assumed one per parameter byte")
    if opt == 0:
        opt = int(ASSUMED_ADAM_STATE_FACTOR * params)
        notes.append(
            "optimizer state not measured (no optimizer step ran): assumed AdamW, 2x the parameter bytes"
        )
    return grads, opt


def _temporaries(summary: dict[str, Any], rest: int, notes: list[str]) -> int:
    """The batch-dependent part of the unaccounted rest: the peak ledger's temporaries when recorded;
    without a ledger the whole rest is kept fixed (it does not shrink with the batch: an upper bound)."""
    led = summary.get("peak_ledger") or {}
    temp = (led.get("categories") or {}).get("temporaries")
    if isinstance(temp, (int, float)) and led.get("step") == summary.get("peak_step"):
        return min(rest, int(temp))
    notes.append(
        "temporaries not attributed (no peak ledger): kept fixed under every change (an upper bound)"
    )
    return 0


def _reserved_ratio(trace: Trace, summary: dict[str, Any]) -> float:
    step = peak_step(trace)
    alloc = (step.memory.get("allocator") or {}) if step else {}
    reserved, allocated = alloc.get("max_reserved"), alloc.get("max_allocated")
    if isinstance(reserved, (int, float)) and isinstance(allocated, (int, float)) and allocated > 0:
        return max(1.0, reserved / allocated)
    return 1.0


def _amp_share(rows: list[dict[str, Any]]) -> float:
    total = sum(r["activation_self_bytes"] or 0 for r in rows)
    halved = sum(r["activation_self_bytes"] or 0 for r in rows if AMP_HALVING_TYPES.search(r["type"] or ""))
    return halved / total if total else 0.0


def _step_ms(summary: dict[str, Any]) -> float | None:
    if summary.get("step_time_ms"):
        return float(summary["step_time_ms"])
    phases = summary.get("phases_ms") or {}
    return float(sum(phases.values())) if phases else None


def _fwd_bwd_ms(summary: dict[str, Any]) -> float | None:
    phases = summary.get("phases_ms") or {}
    if phases.get("forward") is None or phases.get("backward") is None:
        return None
    return float(phases["forward"] + phases["backward"])


def _batch_size(summary: dict[str, Any]) -> int | None:
    """The batch dimension of the largest measured batch: the first dimension its tensors share."""
    largest = (summary.get("data") or {}).get("largest_batch") or {}
    shapes = [v for v in (largest.get("shapes") or {}).values() if v]
    firsts = {v[0] for v in shapes}
    return firsts.pop() if len(firsts) == 1 and min(firsts) > 0 else None


def _offload_rate(summary: dict[str, Any]) -> float | None:
    bw = (summary.get("device") or {}).get("bandwidth") or {}
    found = [bw.get(k) for k in ("h2d_pinned_bytes_per_s", "d2h_pinned_bytes_per_s")]
    rates = [float(r) for r in found if isinstance(r, (int, float)) and r > 0]
    return min(rates) if rates else None


def extrapolate_blocks(
    trace: Trace, rows: list[dict[str, Any]], notes: list[str]
) -> tuple[int, list[Candidate]]:
    """For a step cut short (an OOM): the blocks of a repeated stack that never ran are assumed to save
    what the median block that ran saved, and to take its forward time. Returns the added activation
    bytes and the added checkpoint candidates."""
    by_key = {(r["model"], r["index"]): r for r in rows}
    added, extra = 0, []
    for info in trace.models:
        for blocks in repeated_blocks(info):
            ran = [by_key[(info.index, i)] for i in blocks if by_key[(info.index, i)]["calls"]]
            rest = [by_key[(info.index, i)] for i in blocks if not by_key[(info.index, i)]["calls"]]
            if not ran or not rest:
                continue
            act = int(statistics.median(r["activation_bytes"] or 0 for r in ran))
            free = int(statistics.median(r["checkpoint_free_bytes"] or 0 for r in ran))
            ms = [r["forward_ms"] for r in ran if r["forward_ms"] is not None]
            added += act * len(rest)
            if ms and free >= MIN_CANDIDATE_BYTES:
                extra += [_candidate(trace, r, free, statistics.median(ms)) for r in rest]
            notes.append(
                f"the run died before {len(rest)} of the {len(blocks)} {info.types[blocks[0]]} blocks ran: "
                f"each is assumed to save what the median block that ran saved ({act} bytes); modules "
                "after them are not counted (a lower bound)"
            )
    if not added:
        notes.append(
            "the peak step did not complete (the run died in it): modules that had not run yet are not in "
            "the ledger, so every prediction is a lower bound"
        )
    return added, extra


def _candidate(trace: Trace, row: dict[str, Any], free: int, ms: float) -> Candidate:
    parents = next(m.parents for m in trace.models if m.index == row["model"])
    chain, p = [], parents[row["index"]]
    while p >= 0:
        chain.append((row["model"], p))
        p = parents[p]
    return Candidate(row["name"], row["model"], row["index"], row["depth"], free, float(ms), frozenset(chain))


def candidates(trace: Trace, rows: list[dict[str, Any]]) -> list[Candidate]:
    """Modules below the root with a measured ``checkpoint_free_bytes`` and forward time."""
    out = []
    for r in rows:
        free, ms = r["checkpoint_free_bytes"], r["forward_ms"]
        if r["depth"] >= 1 and free is not None and free >= MIN_CANDIDATE_BYTES and ms is not None:
            out.append(_candidate(trace, r, int(free), ms))
    return out


# ----------------------------------------------------------------------------------------- prediction


def predict(
    w: Workload, config: Config, *, bf16: bool | None = None, offload_bytes_per_s: float | None = None
) -> Prediction:
    """The peak and time of ``config``. ``bf16``: whether the target card has native bf16 (default: the
    profiled device's); ``offload_bytes_per_s``: the target's host link (default: the measured one)."""
    assumptions = list(w.notes)
    chosen = _outermost([c for c in w.candidates if c.name in set(config.checkpoint)])
    parts = memory_parts(w, config, chosen, assumptions)
    allocated = sum(parts.values())
    floor = w.parameters + w.gradients + parts["optimizer_state"] + w.fixed
    if config != Config():
        assumptions.append(
            "gradients counted in full alongside the remaining activations (they are, from the second "
            "micro-batch on; with checkpointing alone this is an upper bound)"
        )
        allocated = max(allocated, floor)
    if w.reserved_ratio > 1.0:
        assumptions.append(
            f"reserved memory = allocated x {w.reserved_ratio:.3f}, the measured ratio at the peak"
        )
    time_parts = time_model(w, config, chosen, bf16, offload_bytes_per_s, assumptions)
    known = [v for v in time_parts.values() if v is not None]
    extra = None if len(known) < len(time_parts) else sum(known)
    ratio = (w.step_ms + extra) / w.step_ms if extra is not None and w.step_ms else None
    return Prediction(
        config, allocated, int(allocated * w.reserved_ratio), parts, extra, ratio, time_parts, assumptions
    )


def _outermost(chosen: list[Candidate]) -> list[Candidate]:
    """A module inside another chosen one frees nothing more: its bytes are in its ancestor's."""
    keys = {c.key for c in chosen}
    return [c for c in chosen if not c.ancestors & keys]


def memory_parts(
    w: Workload, config: Config, chosen: list[Candidate], assumptions: list[str]
) -> dict[str, int]:
    """Bytes per part at the predicted peak of the forward/backward: each lever's effect on its part."""
    if config == Config():
        return {
            "parameters": w.parameters,
            "gradients": w.gradients_at_peak,
            "optimizer_state": w.optimizer_state,
            "activations": w.activations,
            "temporaries": w.temporaries,
            "fixed": w.fixed,
        }
    scale = 1.0 / config.accumulation
    if config.accumulation > 1:
        assumptions.append("activations and temporaries scale linearly with the micro-batch size")
    amp = activation_scale(w, config) / scale
    if config.precision != "fp32":
        assumptions.append(
            f"autocast stores {100 * w.amp_share:.0f}% of the activations (matmul-type modules) in 16 bits; "
            "the script is assumed to run in fp32 now; fp32 master weights and optimizer state stay"
        )
    acts = w.activations * scale * amp
    freed = sum(c.free_bytes for c in chosen) * scale * amp
    recompute = max((c.free_bytes for c in chosen), default=0) * scale * amp
    if chosen:
        assumptions.append(
            "checkpointing frees each chosen module's measured checkpoint_free_bytes (its inputs stay); "
            "the largest block's activations come back while it is recomputed in backward"
        )
    return {
        "parameters": w.parameters,
        "gradients": w.gradients,
        "optimizer_state": optimizer_bytes(w, config, assumptions),
        "activations": int(max(0.0, acts - freed) + recompute),
        "temporaries": int(w.temporaries * scale),
        "fixed": w.fixed,
        "autocast_weight_cache": int(w.matmul_param_bytes * AMP_WEIGHT_CACHE_FACTOR)
        if config.precision != "fp32"
        else 0,
    }


def activation_scale(w: Workload, config: Config) -> float:
    """What the micro-batch and autocast multiply the measured activations by."""
    amp = 1.0 - w.amp_share * (1.0 - AMP_ACTIVATION_FACTOR) if config.precision != "fp32" else 1.0
    return amp / config.accumulation


def optimizer_bytes(w: Workload, config: Config, assumptions: list[str]) -> int:
    if config.optimizer == "8bit":
        assumptions.append("8-bit optimizer: state / 4 (two 8-bit moments instead of two fp32 ones)")
        return int(w.optimizer_state * EIGHT_BIT_STATE_FACTOR)
    if config.optimizer == "offload":
        assumptions.append("optimizer state offloaded: none of it on the GPU (the step runs on the CPU)")
        return 0
    return w.optimizer_state


def time_model(
    w: Workload,
    config: Config,
    chosen: list[Candidate],
    bf16: bool | None,
    offload_rate: float | None,
    assumptions: list[str],
) -> dict[str, float | None]:
    """Milliseconds each lever adds to the measured step (None: not known from this trace)."""
    out: dict[str, float | None] = {}
    if chosen:
        out["recompute"] = sum(c.forward_ms for c in chosen)
        assumptions.append("recomputation costs the measured forward time of each checkpointed module")
    if config.accumulation > 1:
        out["accumulation"] = _accumulation_ms(w, config, assumptions)
    if config.precision != "fp32":
        out["autocast"] = _amp_ms(w, config, bf16, assumptions)
    if config.optimizer == "offload":
        rate = offload_rate or w.offload_bytes_per_s
        moved = w.gradients + w.parameters
        out["offload"] = None if not rate else 1e3 * moved / rate
        assumptions.append(
            "offload moves every gradient to the CPU and every parameter back each step; the CPU "
            "optimizer's own time is not modelled"
            + ("" if rate else "; no host-link bandwidth known, so its cost is unknown")
        )
    return out


def _accumulation_ms(w: Workload, config: Config, assumptions: list[str]) -> float | None:
    share = ACCUMULATION_FIXED_SHARE.get(w.compute_class)
    if share is None or w.fwd_bwd_ms is None:
        assumptions.append(
            "the cost of smaller micro-batches is unknown: compute intensity was not measured (profile "
            "with the flops collector), so how much of the step is fixed per micro-batch is not known"
        )
        return None
    assumptions.append(
        f"each extra micro-batch repeats {100 * share:.0f}% of the forward+backward time (fixed costs of "
        f"a step of compute class {w.compute_class}; an assumption)"
    )
    return w.fwd_bwd_ms * share * (config.accumulation - 1)


def _amp_ms(w: Workload, config: Config, bf16: bool | None, assumptions: list[str]) -> float | None:
    native = w.bf16_native if bf16 is None else bf16
    if w.fwd_bwd_ms is None:
        return None
    if config.precision == "bf16" and not native:
        assumptions.append("bf16 without native support runs no faster (emulated); counted as no change")
        return 0.0
    factor = AMP_TIME_FACTOR[w.compute_class]
    assumptions.append(f"autocast runs forward+backward in {factor:.0%} of the fp32 time (an assumption)")
    return w.fwd_bwd_ms * (factor - 1.0)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
