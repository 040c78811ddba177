"""Several GPUs: what each rank holds under DDP and FSDP2, and which configs the planner spreads over
them (``spread``). A plan for N cards is a ``Config`` with ``gpus`` N and a ``parallel`` engine; the
memory model calls ``engine_parts`` on the parts every other lever has already set (the batch is split
over the ranks there: ``memdoctor.plan.memory.rank_share``), the time model ``memdoctor.plan.comm`` for
the bytes the engine moves. ``from_rank`` turns a rank's trace back into its one-process equivalent, so
that the same model plans any N from it.

Memory per rank (docs/planner.md, "Several GPUs", compares it with DeepSpeed's and FSDPMemTracker's):

- DDP: the whole model state, plus ``gradient_buckets``: one more copy of the gradients, the buckets DDP
  allocates when it wraps the model (``gradient_as_bucket_view=False``, its default, assumed);
- FSDP2 (``fully_shard``): parameters, gradients and optimizer state / N, plus ``unsharded_parameters``
  (the root's unit and the shard units gathered) and ``unsharded_gradients`` (before their
  reduce-scatter) at the largest of the moments of the step ``memdoctor.plan.parallel_fsdp`` names
  (the forward end, the loss, the backward start, late backward), each with its own share of the
  gradients and activations;
- FSDP2 with ``CPUOffloadPolicy`` (``full_offload``): what one process holds under full offload
  (``memdoctor.plan.memory.full_offload_state``): sharded or not, the state lives on the host.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from memdoctor.analysis.layers import ENGINE_CATEGORIES
from memdoctor.plan.config import Config
from memdoctor.plan.memory import OPTIMIZER_STEP_TEMP_FACTOR, ranks, step_floor
from memdoctor.plan.parallel_fsdp import fsdp_parts
from memdoctor.plan.timing import compute_factor
from memdoctor.plan.workload import Workload
from memdoctor.trace import Trace

# DDP's gradient buckets: False (DDP's default) allocates them beside the gradients, one more copy;
# True (the gradients are views into them) would cost nothing more. memdoctor run wraps with the default.
DDP_GRADIENT_AS_BUCKET_VIEW = False
FSDP = ("fsdp2", "fsdp2-no-reshard")
# GPU counts the planner tries when N are not enough ("which cards, and how many").
GPU_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def sharded(config: Config) -> bool:
    return config.parallel in FSDP and ranks(config) > 1


def engine_parts(
    w: Workload, config: Config, parts: dict[str, int], assumptions: list[str]
) -> dict[str, int]:
    """``parts`` (a rank's share of the batch already applied) with the model state each rank holds
    under ``config``'s engine; unchanged for one process and for FSDP2 with CPU offload."""
    n = ranks(config)
    if n == 1:
        return parts
    if sharded(config) and not config.full_offload:
        return fsdp_parts(w, config, parts, shard_units(w, config), assumptions)
    out = dict(parts)
    out["gradients"] = _gradients_at_peak(w, config, parts, assumptions)
    if config.parallel == "ddp":
        out["gradient_buckets"] = 0 if DDP_GRADIENT_AS_BUCKET_VIEW else w.gradients
        assumptions.append(
            f"DDP over {n} ranks: every rank holds the whole model state, and DDP's gradient buckets "
            f"({w.gradients} bytes: gradient_as_bucket_view=False, its default, assumed)"
        )
        return out
    assumptions.append(f"FSDP2 with CPU offload over {n} ranks: each rank holds what one process does")
    return out


def shard_units(w: Workload, config: Config) -> tuple[int, ...]:
    """Parameter bytes of the units ``config`` shards before the root: those of its ``shard_modules``
    (a plan without them wraps the root alone, which then holds every parameter)."""
    names = set(config.shard_modules)
    return tuple(b for n, b in zip(w.shard_names, w.shard_units, strict=False) if n in names)


def _gradients_at_peak(w: Workload, config: Config, parts: dict[str, int], assumptions: list[str]) -> int:
    """The gradients (all of them, before sharding) at the peak: as measured at the profiled peak when
    the step keeps its shape (one micro-batch, nothing checkpointed: a smaller batch per rank moves no
    lever's peak), else as the one-process model counts them (``parts``)."""
    if config.accumulation_steps == 1 and not config.checkpoint and not config.full_offload:
        assumptions.append(
            "the step keeps its shape on each rank (one micro-batch, nothing checkpointed): the peak comes "
            f"where it was measured, with the gradients held there ({w.gradients_at_peak} bytes of "
            f"{w.gradients})"
        )
        return w.gradients_at_peak
    return parts["gradients"]


def engine_floor(w: Workload, config: Config, parts: dict[str, int], assumptions: list[str]) -> int:
    """The optimizer step's own peak on a rank: its model state (every gradient, sharded under FSDP2;
    DDP's buckets too) and the optimizer's temporaries (foreach Adam: one more copy of the parameters
    it updates; torch runs foreach only on CUDA tensors, so none on a CPU run); ``step_floor`` for one
    process and under CPU offload."""
    if ranks(config) == 1 or config.full_offload:
        return step_floor(w, config, parts, assumptions)
    n = ranks(config) if sharded(config) else 1
    params, grads = math.ceil(w.parameters / n), math.ceil(w.gradients / n)
    temps = 0
    if config.optimizer == "as-is" and parts["optimizer_state"] and w.device_kind != "cpu":
        temps = int(params * OPTIMIZER_STEP_TEMP_FACTOR)
    return params + grads + parts.get("gradient_buckets", 0) + parts["optimizer_state"] + w.fixed + temps


# ----------------------------------------------------------------------------------------- the search


def per_rank_batch(w: Workload, n: int) -> int | None:
    """A rank's batch when the measured batch is split over ``n`` ranks; None when it was not measured."""
    return -(-w.batch_size // n) if w.batch_size else None


def splits_over(w: Workload, n: int) -> bool:
    """Whether the measured batch gives every one of ``n`` ranks at least one sample (unknown: yes)."""
    return w.batch_size is None or w.batch_size >= n


def spread(w: Workload, gpus: int, configs: list[Config]) -> list[Config]:
    """``configs`` (one process's search) spread over ``gpus`` ranks: each with DDP, FSDP2 and FSDP2
    without resharding; full offload with FSDP2 only (CPUOffloadPolicy). Levers an engine replaces are
    left out: parameter and optimizer offload (FSDP2 with CPU offload is the engine's own), the 8-bit
    optimizer with FSDP2 (bitsandbytes' state on sharded DTensor parameters is not assumed to work).
    Micro-batch counts must divide a rank's batch. ``configs`` as they are for one GPU."""
    if gpus <= 1:
        return configs
    batch = per_rank_batch(w, gpus)
    out: list[Config] = []
    for c in configs:
        if c.offload_parameters or c.optimizer == "offload":
            continue
        if batch is not None and (batch % c.accumulation_steps or batch < c.accumulation_steps):
            continue
        engines = ("fsdp2",) if c.full_offload else ("ddp", *FSDP) if c.optimizer != "8bit" else ("ddp",)
        for engine in engines:
            blocks = w.shard_names if engine in FSDP else ()
            out.append(dataclasses.replace(c, gpus=gpus, parallel=engine, shard_modules=blocks))
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------- a rank's trace

# ``summary.json`` categories an engine's own buffers are measured as (the ledger of a DDP or FSDP2 rank:
# ``gradient_buckets``, ``sharding_buffers``; docs/trace-format.md); read with ``.get``: what is not
# there stays in the fixed rest. One list, the capture's (``memdoctor.analysis.layers``).
# A rank's measured parameters under this share of the model's parameter bytes (its module table) are
# taken as sharded (FSDP: each rank holds 1/N); above it, whole (DDP).
SHARDED_BELOW = 0.75


def distributed(header: dict[str, Any]) -> dict[str, Any]:
    """The header's ``distributed`` record (a rank's trace), or an empty one (one process)."""
    found = header.get("distributed")
    return found if isinstance(found, dict) else {}


def from_rank(w: Workload, trace: Trace, summary: dict[str, Any]) -> Workload:
    """The one-process equivalent of a rank's workload (a trace whose header says ``distributed`` with
    a ``world_size`` above 1); ``w`` itself for a one-process trace.

    A rank measured a share of the batch and (under FSDP) a share of the model state: the parts that
    scale with the batch (activations, temporaries, what each checkpoint candidate frees, the forward
    outputs, the batch itself, the forward+backward time) are multiplied back by the world size, the
    state by it when it was sharded (the applied config says FSDP2, or the measured parameters are
    under ``SHARDED_BELOW`` of the module table's), and the engine's own buffers measured as categories
    of their own (``ENGINE_CATEGORIES``) leave the fixed rest. The measured collective time per step
    leaves the step time. Planning N = the world size with the engine it ran then predicts about what
    it measured."""
    size = distributed(trace.header).get("world_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        return w
    applied = trace.header.get("applied_config")
    model_bytes = sum(sum(m.param_bytes) for m in trace.models)
    ran_fsdp = isinstance(applied, dict) and applied.get("parallel") in FSDP
    fsdp = ran_fsdp or (model_bytes > 0 and w.parameters < SHARDED_BELOW * model_bytes)
    state = size if fsdp else 1
    cats = summary.get("categories") or {}
    engine = sum(int(cats.get(c) or 0) for c in ENGINE_CATEGORIES)
    rank = distributed(trace.header).get("rank")
    note = (
        f"planned from rank {rank} of a {size}-rank job: its batch share x{size} (activations, "
        f"temporaries, forward+backward time), its model state x{state} "
        f"({'sharded: FSDP' if fsdp else 'whole on every rank: DDP'}), the engine's measured buffers "
        f"({engine} bytes) and collective time out of the fixed rest and the step: its one-process "
        "equivalent (an estimate, not a measurement of one process)"
    )
    return _scaled(w, size, state, engine, collective_ms(trace), note)


def _scaled(w: Workload, size: int, state: int, engine: int, coll_ms: float, note: str) -> Workload:
    """``w`` with its batch share x ``size`` and its state x ``state`` (``from_rank``)."""
    rank_fwd_bwd = None if w.fwd_bwd_ms is None else max(0.0, w.fwd_bwd_ms - coll_ms)
    grow = 1.0 / compute_factor(w, size)  # a rank's compute time to one process's
    fwd_bwd = None if rank_fwd_bwd is None else rank_fwd_bwd * grow
    step = None if w.step_ms is None else max(0.0, w.step_ms - coll_ms)
    if step is not None and fwd_bwd is not None and rank_fwd_bwd is not None:
        step += fwd_bwd - rank_fwd_bwd
    cands = [
        dataclasses.replace(c, free_bytes=c.free_bytes * size, forward_ms=c.forward_ms * grow)
        for c in w.candidates
    ]
    acts, temps, fixed = w.activations * size, w.temporaries * size, max(0, w.fixed - engine)
    params, grads, opt = w.parameters * state, w.gradients * state, w.optimizer_state * state
    return dataclasses.replace(
        w,
        peak_bytes=params + w.gradients_at_peak * state + opt + acts + temps + fixed,
        parameters=params,
        gradients_at_peak=w.gradients_at_peak * state,
        gradients=grads,
        optimizer_state=opt,
        activations=acts,
        forward_end_activations=_times(w.forward_end_activations, size),
        forward_end_gradients=_times(w.forward_end_gradients, state),
        temporaries=temps,
        fixed=fixed,
        outside_bytes=w.outside_bytes * size,
        root_output_bytes=w.root_output_bytes * size,
        attention_temporaries=w.attention_temporaries * size,
        candidates=cands,
        batch_size=None if w.batch_size is None else w.batch_size * size,
        fwd_bwd_ms=fwd_bwd,
        step_ms=step,
        optimizer_ms=None if w.optimizer_ms is None else w.optimizer_ms * state,
        matmul_param_bytes=w.matmul_param_bytes * state,
        measured_world_size=size,
        notes=[*w.notes, note],
    )


def _times(x: int | None, k: int) -> int | None:
    return None if x is None else x * k


def collective_ms(trace: Trace) -> float:
    """The median measured collective time of the profiled steps (a step's ``collectives``:
    ``{"ms", "calls", "bytes", "by_op"}``, read where the step record keeps it), else 0."""
    found = []
    for step in trace.profiled_steps():
        rec = getattr(step, "collectives", None) or (step.collectors or {}).get("collectives")
        ms = rec.get("ms") if isinstance(rec, dict) else None
        if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms >= 0:
            found.append(float(ms))
    return statistics.median(found) if found else 0.0
