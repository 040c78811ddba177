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

import math
import re
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from memdoctor.analysis.layers import layer_table, repeated_blocks
from memdoctor.analysis.steps import peak_step
from memdoctor.trace import Trace

# Autocast (bf16/fp16): activations saved by matmul-type modules and the elementwise ops that consume
# their outputs are stored in 16 bits, half of fp32; other modules (LayerNorm, softmax in fp32, embeddings)
# keep fp32. An assumption to calibrate.
AMP_ACTIVATION_FACTOR = 0.5
AMP_HALVING_TYPES = re.compile(r"Linear|Conv|Attention|GELU|ReLU|SiLU|Tanh|Sigmoid|Mish|MLP", re.I)
# Code sites of eager attention's temporaries in the peak ledger (seq x seq scores and probabilities).
ATTENTION_SITE = re.compile(r"attention|attn|softmax|baddbmm|scaled_dot", re.I)
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
# Time: autocast from the device's capabilities (``amp_time_factor``). 16-bit matmuls are assumed to
# reach this share of the datasheet tensor-core peak (fp32's own time is taken at 100% of its peak, a
# lower bound, so the 16-bit time is not flattered); the rest of forward+backward (elementwise, norms,
# casts) runs in this share of its fp32 time. Both assumptions to calibrate.
AMP_TENSOR_EFFICIENCY = 0.5
AMP_OTHER_TIME_FACTOR = 0.9
MIN_CANDIDATE_BYTES = 1024**2  # modules freeing less are not worth a checkpoint wrapper
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("as-is", "8bit", "offload")
# Padding policies: "as-is" (as profiled), "longest" (trim each batch to its longest sequence: changes
# no data), "p90"/"p99" (truncate sequences to that length percentile: changes the data, so the planner
# only offers it as an alternative, labelled).
PADDINGS = ("as-is", "longest", "p90", "p99")
PAD_MULTIPLE = 8  # pad_to_multiple_of the planner proposes (tensor cores like multiples of 8)
# Trimming padding to each batch's longest sequence is proposed only where the mean batch gets at least
# this much shorter. Trimmed batches change shape from step to step, and that is not free: on the H200
# the story's bf16 BERT-base b32 step ran 16% slower trimmed (455 vs 531 samples/s, 2% of the columns
# cut), and a plan near the cap with trimmed batches had allocator-bound steps of up to 2.4 s
# (BENCHMARKS.md, the story's scenario). Below this, the dynamic_padding finding still reports it.
TRIM_MIN_SAVING = 0.10
# Parameter offload: modules holding at least this share of the parameter bytes are candidates, least
# forward time per parameter byte first (embeddings, then LM heads); at most this many are tried.
OFFLOAD_MIN_SHARE = 0.05
OFFLOAD_MAX_MODULES = 2
# Allocator: expandable_segments is assumed to keep this share of the measured reserved - allocated gap
# (segments grow in place instead of leaving gaps). An assumption, labelled in every prediction.
EXPANDABLE_GAP_KEPT = 0.5
# Calibrated on the H200 against 20 (workload, config) pairs of BERT-base, GPT-2 small, ViT-base and a
# ~1B Llama-style decoder (benchmarks/plan_accuracy.py; BENCHMARKS.md, "Planner prediction accuracy"):
# torch's foreach Adam/AdamW allocates sqrt(exp_avg_sq) anew for every parameter, so the optimizer
# step's own peak is the model state plus one more copy of the parameters (the 1B decoder's checkpointed
# peak is set by it).
OPTIMIZER_STEP_TEMP_FACTOR = 1.0
# With checkpointing alone the backward peak comes mid-backward, when about half of the gradients exist
# (counting all of them over-predicted the checkpointed peaks of BERT, GPT-2 and ViT by 13-18%).
CHECKPOINT_GRADIENT_SHARE = 0.5
# Reserved / allocated of a changed config: the allocator's slack grows when the allocation pattern
# changes (measured 1.02-1.10 for micro-batching and autocast, 1.11-1.20 with checkpointing, against
# 1.01-1.08 as profiled); the measured ratio is kept when it is larger.
CHANGED_RESERVED_RATIO = 1.06
CHECKPOINT_RESERVED_RATIO = 1.15


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


@dataclass(frozen=True)
class ParamHolder:
    """A module whose parameters could live on the CPU: what that frees and what moving them costs."""

    name: str
    param_bytes: int
    grad_bytes: int
    forward_ms: float | None


@dataclass(frozen=True)
class Padding:
    """What the data collector measured about padding, for the padding-policy levers.

    ``padded`` is the padded length every token batch had; ``worst_longest`` the longest real sequence
    of any batch (trimming must plan for it: the long tail, not the mean); ``longest`` every batch's
    longest real sequence (the mean of these sets the time saving); ``percentiles`` the real lengths'
    p90/p99 over all sequences."""

    padded: int
    worst_longest: int
    longest: tuple[int, ...]
    percentiles: dict[str, float]

    def length(self, policy: str, longest: int, multiple: int) -> int:
        """The length one batch is padded to under ``policy`` (never more than as profiled)."""
        cut = longest
        if policy in self.percentiles:
            cut = min(longest, math.ceil(self.percentiles[policy]))
        if multiple > 1:
            cut = -(-cut // multiple) * multiple
        return min(self.padded, max(1, cut))

    def ratio(self, policy: str, multiple: int) -> float:
        """Padded length of the largest batch under ``policy`` / the profiled padded length."""
        return self.length(policy, self.worst_longest, multiple) / self.padded

    def mean_ratio(self, policy: str, multiple: int) -> float:
        return statistics.mean(self.length(policy, n, multiple) for n in self.longest) / self.padded

    def worth_trimming(self) -> bool:
        """Does trimming to the longest save enough to pay for batches that change shape?"""
        return self.mean_ratio("longest", PAD_MULTIPLE) <= 1.0 - TRIM_MIN_SAVING


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
    padding: Padding | None = None  # None: no token batch with real lengths was measured
    padding_unavailable: str | None = None  # why the padding levers are unavailable
    attention_temporaries: int = 0  # peak-ledger temporaries allocated in eager attention code
    param_holders: list[ParamHolder] = field(default_factory=list)  # offload candidates, best first
    device_name: str | None = None  # the profiled GPU (for its datasheet peaks)
    peak_fraction: float | None = None  # measured FLOP/s over the profiled GPU's fp32 datasheet peak
    scale_window_log2: tuple[int, int] | None = None  # fp16 loss scales that fit the measured gradients
    suggested_scale_log2: int | None = None
    # The script as it is ran out of memory under this budget (this workload then comes from a re-profile
    # at a smaller micro-batch, scaled back to the full batch): the unchanged config does not fit in it.
    as_is_oom_budget: int | None = None
    # Every predicted reserved peak is multiplied by this (``corrected_workload``: what a verified run
    # measured beyond the prediction); 1.0 as profiled.
    memory_correction: float = 1.0


@dataclass(frozen=True)
class Config:
    """A what-if: the levers applied on top of the profiled run (which is ``Config()``)."""

    checkpoint: tuple[str, ...] = ()  # module names, none nested in another
    accumulation: int = 1  # micro-batches per step: the micro-batch is the measured batch / accumulation
    precision: str = "fp32"  # "fp32" (as profiled), "bf16" or "fp16" autocast
    optimizer: str = "as-is"  # "as-is", "8bit" (8-bit optimizer state), "offload" (state on the CPU)
    padding: str = "as-is"  # one of PADDINGS
    pad_multiple: int = 1  # pad_to_multiple_of with a padding policy
    offload: tuple[str, ...] = ()  # modules whose parameters (and gradients) live on the CPU
    attention: str = "as-is"  # "as-is" or "sdpa" (memory-efficient attention instead of eager)
    allocator: str = "as-is"  # "as-is" or "expandable" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)

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
        return out + self._more_levers()

    def _more_levers(self) -> list[str]:
        out = []
        multiple = f", pad_to_multiple_of={self.pad_multiple}" if self.pad_multiple > 1 else ""
        if self.padding == "longest":
            out.append(f"pad each batch to its longest sequence{multiple}")
        elif self.padding != "as-is":
            out.append(f"truncate sequences to their {self.padding} length{multiple} (changes the data)")
        if self.offload:
            out.append(f"parameters of {', '.join(self.offload)} offloaded to the CPU")
        if self.attention == "sdpa":
            out.append("memory-efficient attention (SDPA) instead of eager")
        if self.allocator == "expandable":
            out.append("allocator expandable_segments")
        return out

    def families(self) -> list[str]:
        """The lever families this config uses (the nine-grid's priority table orders them)."""
        found = {
            "checkpoint": bool(self.checkpoint),
            "accumulation": self.accumulation > 1,
            "precision": self.precision != "fp32",
            "8bit": self.optimizer == "8bit",
            "offload": self.optimizer == "offload" or bool(self.offload),
            "padding": self.padding != "as-is",
            "attention": self.attention != "as-is",
            "allocator": self.allocator != "as-is",
        }
        return [k for k, used in found.items() if used]

    def changes_data(self) -> bool:
        return self.padding not in ("as-is", "longest")

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": list(self.checkpoint),
            "accumulation_steps": self.accumulation,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "padding": self.padding,
            "pad_to_multiple_of": self.pad_multiple if self.pad_multiple > 1 else None,
            "offload_parameters": list(self.offload),
            "attention": self.attention,
            "allocator": self.allocator,
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


# ----------------------------------------------------------------------------------------- calibration


def workload(trace: Trace, summary: dict[str, Any]) -> Workload | None:
    """What the planner plans from: the trace's own measurements (``measured_workload``) or, when the run
    died before its first forward finished and ``memdoctor profile`` re-profiled it at a smaller
    micro-batch, that measurement scaled back to the full batch (``memdoctor.plan.reprofiled``)."""
    from memdoctor.plan.reprofiled import reprofiled_workload  # it builds on this module's Workload

    return reprofiled_workload(trace) or measured_workload(trace, summary)


def measured_workload(trace: Trace, summary: dict[str, Any]) -> Workload | None:
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
    cands = candidates(trace, rows, notes)
    pad, pad_why = padding_facts(trace, summary)
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
        fwd_bwd_ms=_fwd_bwd_ms(summary)
        or _warmup_fwd_bwd(trace, notes)
        or (None if complete else _estimated_fwd_bwd(trace, rows, notes)),
        compute_class=(summary.get("compute") or {}).get("class"),
        batch_size=_batch_size(summary),
        complete=complete,
        candidates=cands,
        offload_bytes_per_s=_offload_rate(summary),
        bf16_native=(summary.get("device") or {}).get("bf16_native"),
        precision_verdict=(summary.get("precision") or {}).get("verdict"),
        notes=notes,
        padding=pad,
        padding_unavailable=pad_why,
        attention_temporaries=attention_temporaries(summary, temporaries),
        param_holders=param_holders(rows),
        device_name=_device_name(summary),
        peak_fraction=(summary.get("compute") or {}).get("peak_fraction"),
        scale_window_log2=_window(summary),
        suggested_scale_log2=(summary.get("precision") or {}).get("suggested_init_scale_log2"),
    )


def padding_facts(trace: Trace, summary: dict[str, Any]) -> tuple[Padding | None, str | None]:
    """The padding levers' measurements, or None with the reason they are unavailable. Every step's
    batches count (warm-up too): the longest batch seen is what a trimmed plan must hold."""
    padded, longest = set(), []
    for step in trace.steps:
        data = step.collectors.get("data")
        batches = data.get("batches") if isinstance(data, dict) else None
        for b in batches if isinstance(batches, list) else []:
            length = _padded_length(b) if isinstance(b, dict) else None
            lengths = b.get("lengths") if length else None
            real = [n for n in lengths if _count(n)] if isinstance(lengths, list) else []
            if length and real:
                padded.add(length)
                longest.append(max(real))
    if not longest:
        return None, "no token batch with real lengths was measured (profile with the data collector)"
    if len(padded) > 1:
        return None, f"batches are already padded to different lengths ({len(padded)} seen): trimmed"
    if min(longest) >= max(padded):
        return None, "every measured batch's longest sequence fills its padded length: nothing to trim"
    pct = ((summary.get("data") or {}).get("lengths")) or {}
    found = {k: float(pct[k]) for k in ("p90", "p99") if isinstance(pct.get(k), (int, float))}
    return Padding(padded.pop(), max(longest), tuple(longest), found), None


def _padded_length(batch: dict[str, Any]) -> int | None:
    """The padded length of a token batch: the second dimension of its batch x length matrix (a trace
    is untrusted input: anything of the wrong type is skipped)."""
    tokens, shapes = batch.get("tokens"), batch.get("shapes")
    if not _count(tokens) or not isinstance(shapes, dict):
        return None
    for shape in shapes.values():
        matrix = isinstance(shape, list) and len(shape) == 2 and all(_count(d) for d in shape)
        if matrix and shape[0] * shape[1] == tokens:
            return int(shape[1])
    return None


def _count(x: Any) -> bool:
    """A positive whole number (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def attention_temporaries(summary: dict[str, Any], temporaries: int) -> int:
    """The peak ledger's temporaries allocated in attention code (eager attention's seq x seq scores)."""
    led = summary.get("peak_ledger") or {}
    found = sum(
        int(b)
        for s, b in led.get("temporaries_by_site") or []
        if ATTENTION_SITE.search(str(s)) and isinstance(b, (int, float))
    )
    return min(found, temporaries)


def param_holders(rows: list[dict[str, Any]]) -> list[ParamHolder]:
    """Modules holding at least ``OFFLOAD_MIN_SHARE`` of the parameter bytes, least forward time per
    parameter byte first: embeddings (a lookup) before LM heads (a matmul)."""
    total = sum(r["param_bytes"] or 0 for r in rows)
    big = [r for r in rows if total and (r["param_bytes"] or 0) >= OFFLOAD_MIN_SHARE * total]
    big.sort(key=lambda r: ((r["forward_ms"] or 0.0) / r["param_bytes"], r["index"]))
    return [
        ParamHolder(
            r["name"], int(r["param_bytes"]), int(r["grad_bytes"] or r["param_bytes"]), r["forward_ms"]
        )
        for r in big[:OFFLOAD_MAX_MODULES]
    ]


def _device_name(summary: dict[str, Any]) -> str | None:
    device = summary.get("device") or {}
    return device.get("name") if device.get("kind") == "cuda" else None


def _window(summary: dict[str, Any]) -> tuple[int, int] | None:
    window = (summary.get("precision") or {}).get("scale_window_log2")
    return (int(window[0]), int(window[1])) if isinstance(window, list) and len(window) == 2 else None


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


def _warmup_fwd_bwd(trace: Trace, notes: list[str]) -> float | None:
    """Forward + backward ms of the last complete warm-up step, for a run whose profiled steps have no
    phase times (it died of OOM in the first profiled step, as ViT-base b64 did at step 1 once AdamW's
    state arrived). Warm-up times include first-call costs (autotuning, allocation): an over-estimate,
    but every lever's time is costed from the same figure, so their ranking holds."""
    for step in reversed(trace.steps):
        forward, backward = step.phases_ms.get("forward"), step.phases_ms.get("backward")
        if step.warmup and step.complete and forward and backward:
            notes.append(
                f"forward + backward time {forward + backward:.1f} ms from warm-up step {step.step} (no "
                "profiled step finished; warm-up includes first-call costs: an over-estimate)"
            )
            return float(forward + backward)
    return None


# Backward over forward time: backward computes two matmuls (input and weight gradients) for every one of
# the forward, the usual estimate where the backward was not measured.
BACKWARD_OVER_FORWARD = 2.0


def _estimated_fwd_bwd(trace: Trace, rows: list[dict[str, Any]], notes: list[str]) -> float | None:
    """Forward + backward ms of a step that died in its forward (an OOM at step 0 has no phase times):
    the largest repeated stack's blocks, each at the median forward time of those that ran, times
    (1 + ``BACKWARD_OVER_FORWARD``). Without it the cost of micro-batching is unknown and the planner
    would rank every config that needs it after any config whose cost it knows."""
    by_key = {(r["model"], r["index"]): r for r in rows}
    best: tuple[int, float] | None = None
    for info in trace.models:
        for blocks in repeated_blocks(info):
            ms = [by_key[(info.index, i)]["forward_ms"] for i in blocks]
            ran = [m for m in ms if m is not None]
            if ran and (best is None or len(blocks) > best[0]):
                best = (len(blocks), len(blocks) * statistics.median(ran))
    if best is None:
        return None
    notes.append(
        f"forward + backward time estimated at {best[1] * (1 + BACKWARD_OVER_FORWARD):.1f} ms: the {best[0]} "
        f"repeated blocks at the median measured block forward time, backward taken as "
        f"{BACKWARD_OVER_FORWARD:g}x the forward (the run died before its backward; an assumption). "
        "These are times of the step it died in, often the first (warm-up, autotuning): absolute costs are "
        "over-estimated, but recomputation and micro-batching are costed from the same times"
    )
    return best[1] * (1 + BACKWARD_OVER_FORWARD)


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


def candidates(trace: Trace, rows: list[dict[str, Any]], notes: list[str] | None = None) -> list[Candidate]:
    """Modules below the root with a measured ``checkpoint_free_bytes`` and forward time (a block's
    first-call outlier capped: ``steady_forward_ms``)."""
    out = []
    for r in rows:
        free, ms = r["checkpoint_free_bytes"], r["forward_ms"]
        if r["depth"] >= 1 and free is not None and free >= MIN_CANDIDATE_BYTES and ms is not None:
            out.append(_candidate(trace, r, int(free), ms))
    return steady_forward_ms(out, notes if notes is not None else [])


# A module of a repeated stack whose forward took more than this many times the median of the same
# module in the other blocks is taken at that median: the first block's first call carries one-off
# costs (library handles, kernel autotuning). In GPT-2's re-profile under the HF Trainer, whose peak
# step was its warm-up, block 0 took 188 ms against 19 ms for each of the others, and costed
# checkpointing every block at twice its recomputation.
STACK_OUTLIER_FACTOR = 2.0
STACK_MIN_BLOCKS = 3
_STACK_INDEX = re.compile(r"\.\d+(?=\.|$)")


def steady_forward_ms(cands: list[Candidate], notes: list[str]) -> list[Candidate]:
    """``cands`` with each stack outlier's forward time set to its siblings' median (constants above)."""
    groups: dict[tuple[int, int, str], list[float]] = {}
    for c in cands:
        groups.setdefault(_sibling_key(c), []).append(c.forward_ms)
    out, capped = [], []
    for c in cands:
        times = groups[_sibling_key(c)]
        median = statistics.median(times) if len(times) >= STACK_MIN_BLOCKS else None
        if median is not None and c.forward_ms > STACK_OUTLIER_FACTOR * median:
            capped.append(f"{c.name} {c.forward_ms:.1f} ms")
            c = replace(c, forward_ms=median)
        out.append(c)
    if capped:
        notes.append(
            f"forward time taken at the median of the same module in the other blocks for {len(capped)} "
            f"module{'s' if len(capped) > 1 else ''} measured at over {STACK_OUTLIER_FACTOR:g}x it "
            f"({', '.join(capped[:3])}{', ...' if len(capped) > 3 else ''}: first-call costs)"
        )
    return out


def _sibling_key(c: Candidate) -> tuple[int, int, str]:
    return (c.model, c.depth, _STACK_INDEX.sub(".#", c.name))


# ----------------------------------------------------------------------------------------- prediction


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
    chosen = _outermost([c for c in w.candidates if c.name in set(config.checkpoint)])
    parts = memory_parts(w, config, chosen, assumptions)
    allocated = sum(parts.values())
    floor = step_floor(w, config, parts, assumptions)
    if config != Config():
        if not (chosen and config.accumulation == 1):
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
    if config.allocator == "expandable" and w.reserved_ratio > 1.0:
        assumptions[-1] = (
            f"expandable_segments assumed to keep {EXPANDABLE_GAP_KEPT:.0%} of the measured reserved - "
            f"allocated gap: reserved = allocated x {ratio:.3f} instead of the measured "
            f"{w.reserved_ratio:.3f} (an assumption)"
        )
    basis: dict[str, str] = {}
    time_parts = time_model(
        w, config, chosen, _Link(bf16, offload_bytes_per_s, card_name), assumptions, basis
    )
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


def reserved_ratio(w: Workload, config: Config) -> float:
    """Reserved / allocated: as measured, at least the calibrated slack of a changed config, and shrunk
    toward 1 by expandable segments (an assumption); times a verified run's ``memory_correction``."""
    ratio = w.reserved_ratio
    if config != Config():
        ratio = max(ratio, CHECKPOINT_RESERVED_RATIO if config.checkpoint else CHANGED_RESERVED_RATIO)
    if config.allocator == "expandable":
        ratio = 1.0 + (ratio - 1.0) * EXPANDABLE_GAP_KEPT
    return ratio * w.memory_correction


def checkpointed_gradients(grads: int, config: Config) -> int:
    """The gradient bytes at the backward peak of ``config`` with modules checkpointed: a share of them
    with checkpointing alone (the peak comes mid-backward), all of them with micro-batches, and all of
    them with the optimizer offloaded: without the optimizer step's own peak the backward's last blocks
    set it, when nearly every gradient exists (the 0.95B decoder's offload plan on the H200 peaked in
    block 1's backward holding 3.12 of its 3.06-3.5 GiB of gradients; BENCHMARKS.md, "Offload")."""
    if config.accumulation == 1 and config.optimizer != "offload":
        return int(grads * CHECKPOINT_GRADIENT_SHARE)
    return grads


def step_floor(w: Workload, config: Config, parts: dict[str, int], assumptions: list[str]) -> int:
    """The optimizer step's own peak: parameters, every gradient, the optimizer state, the fixed rest,
    and the optimizer's temporaries (foreach Adam: one more copy of the parameters it updates)."""
    _, grads = offloaded_state(w, config, [])
    temps = 0
    if config.optimizer == "as-is" and parts["optimizer_state"]:
        temps = int(parts["parameters"] * OPTIMIZER_STEP_TEMP_FACTOR)
    floor = parts["parameters"] + grads + parts["optimizer_state"] + w.fixed + temps
    if temps and config != Config():
        assumptions.append(
            f"the optimizer step peaks at the model state + {OPTIMIZER_STEP_TEMP_FACTOR:g}x the parameters "
            "(foreach Adam's temporaries; calibrated on the GPU)"
        )
    return floor


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
    seq = padding_scale(w, config, assumptions)
    amp = activation_scale(w, config) / scale / seq
    if config.precision != "fp32":
        assumptions.append(
            f"autocast stores {100 * w.amp_share:.0f}% of the activations (matmul-type modules) in 16 bits; "
            "the script is assumed to run in fp32 now; fp32 master weights and optimizer state stay"
        )
    acts = w.activations * scale * amp * seq
    freed = sum(c.free_bytes for c in chosen) * scale * amp * seq
    recompute = max((c.free_bytes for c in chosen), default=0) * scale * amp * seq
    if chosen:
        assumptions.append(
            "checkpointing frees each chosen module's measured checkpoint_free_bytes (its inputs stay); "
            "the largest block's activations come back while it is recomputed in backward"
        )
    params, grads = offloaded_state(w, config, assumptions)
    if chosen and config.accumulation == 1 and config.optimizer != "offload":
        grads = checkpointed_gradients(grads, config)
        assumptions.append(
            f"with checkpointing alone the backward peak holds {CHECKPOINT_GRADIENT_SHARE:.0%} of the "
            "gradients (it comes mid-backward; calibrated on the GPU)"
        )
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_state": optimizer_bytes(w, config, assumptions),
        "activations": int(max(0.0, acts - freed) + recompute),
        "temporaries": int(_temporaries_left(w, config, assumptions) * scale * seq),
        "fixed": w.fixed,
        "autocast_weight_cache": int(w.matmul_param_bytes * AMP_WEIGHT_CACHE_FACTOR)
        if config.precision != "fp32"
        else 0,
    }


def activation_scale(w: Workload, config: Config) -> float:
    """What the micro-batch, the padding policy and autocast multiply the measured activations by."""
    amp = 1.0 - w.amp_share * (1.0 - AMP_ACTIVATION_FACTOR) if config.precision != "fp32" else 1.0
    return amp * padding_scale(w, config) / config.accumulation


def padding_scale(w: Workload, config: Config, assumptions: list[str] | None = None) -> float:
    """Padded length of the largest measured batch under the policy / as profiled (1: unchanged)."""
    if config.padding == "as-is" or w.padding is None:
        return 1.0
    ratio = w.padding.ratio(config.padding, config.pad_multiple)
    if assumptions is not None:
        assumptions.append(
            f"padding policy {config.padding}: the largest measured batch would be padded to "
            f"{w.padding.length(config.padding, w.padding.worst_longest, config.pad_multiple)} of "
            f"{w.padding.padded} positions; activations and temporaries scale linearly with the length "
            "(attention scores shrink with its square: an upper bound)"
        )
    return ratio


def _temporaries_left(w: Workload, config: Config, assumptions: list[str]) -> int:
    if config.attention != "sdpa" or not w.attention_temporaries:
        return w.temporaries
    assumptions.append(
        f"memory-efficient attention removes the {w.attention_temporaries} bytes of peak temporaries "
        "measured in eager attention code (seq x seq scores); the probabilities it saves for backward "
        "are kept (an upper bound)"
    )
    return w.temporaries - w.attention_temporaries


def offloaded_state(w: Workload, config: Config, assumptions: list[str]) -> tuple[int, int]:
    """Parameters and gradients left on the GPU when the chosen modules' parameters live on the CPU."""
    held = [h for h in w.param_holders if h.name in set(config.offload)]
    if not held:
        return w.parameters, w.gradients
    largest = max(h.param_bytes for h in held)
    assumptions.append(
        "offloaded parameters are copied in while their module runs: the largest one's "
        f"({largest} bytes) is counted at the peak (an upper bound for an input embedding); their "
        "gradients move to the CPU as they are produced; their optimizer state stays unless the "
        "optimizer is offloaded too"
    )
    params = w.parameters - sum(h.param_bytes for h in held) + largest
    return max(0, params), max(0, w.gradients - sum(h.grad_bytes for h in held))


def optimizer_bytes(w: Workload, config: Config, assumptions: list[str]) -> int:
    if config.optimizer == "8bit":
        assumptions.append("8-bit optimizer: state / 4 (two 8-bit moments instead of two fp32 ones)")
        return int(w.optimizer_state * EIGHT_BIT_STATE_FACTOR)
    if config.optimizer == "offload":
        assumptions.append("optimizer state offloaded: none of it on the GPU (the step runs on the CPU)")
        return 0
    return w.optimizer_state


def corrected_workload(w: Workload, factor: float) -> Workload:
    """``w`` with every predicted reserved peak raised ``factor``-fold.

    The planner predicts reserved = allocated x ``reserved_ratio(w, config)`` and checks the budget
    against it; ``memory_correction`` multiplies that ratio after the calibrated floors of a changed
    config (scaling the measured ratio itself, as before, was swallowed by those floors: a x1.11
    correction of a measured 1.02 stayed under the 1.15 of a checkpointed config and changed nothing).
    No other part of the model changes. It is deliberately blunt (the whole peak, not the part that
    was wrong) and so errs towards memory."""
    note = f"memory predictions raised x{factor:.3f}: a verified run measured that much more than predicted"
    return replace(w, memory_correction=w.memory_correction * factor, notes=[*w.notes, note])


# ----------------------------------------------------------------------------------------- time


@dataclass(frozen=True)
class _Link:
    """What the time model needs of the target: native bf16, host-link rate, card name."""

    bf16: bool | None
    rate: float | None
    card: str | None


def time_model(
    w: Workload,
    config: Config,
    chosen: list[Candidate],
    target: _Link,
    assumptions: list[str],
    basis: dict[str, str],
) -> dict[str, float | None]:
    """Milliseconds each lever adds to the measured step (None: not known from this trace); ``basis``
    gets, per part, what its figure rests on (measured, datasheet or an assumption)."""
    out: dict[str, float | None] = {}
    if chosen:
        out["recompute"] = sum(c.forward_ms for c in chosen)
        basis["recompute"] = "measured: the forward time of each checkpointed module"
        assumptions.append("recomputation costs the measured forward time of each checkpointed module")
    if config.accumulation > 1:
        out["accumulation"] = _accumulation_ms(w, config, assumptions)
        basis["accumulation"] = "assumption: a fixed share per micro-batch by the measured compute class"
    if config.precision != "fp32":
        out["autocast"] = _amp_ms(w, config, target, assumptions, basis)
    if config.optimizer == "offload":
        out["offload"] = _transfer_ms(w, w.gradients + w.parameters, target, basis, "offload")
        assumptions.append(
            "offload moves every gradient to the CPU and every parameter back each step; the CPU "
            "optimizer's own time is not modelled"
            + ("" if out["offload"] is not None else "; no host-link bandwidth known, so its cost is unknown")
        )
    _more_time(w, config, target, assumptions, basis, out)
    return out


def _more_time(
    w: Workload,
    config: Config,
    target: _Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    """The time of the padding, parameter-offload, attention and allocator levers."""
    if config.padding != "as-is" and w.padding is not None:
        mean = w.padding.mean_ratio(config.padding, config.pad_multiple)
        out["padding"] = (mean - 1.0) * w.fwd_bwd_ms if w.fwd_bwd_ms else 0.0
        basis["padding"] = (
            f"measured lengths: the mean batch would be {mean:.0%} as long; forward+backward time assumed "
            "linear in the length" + ("" if w.fwd_bwd_ms else "; no phase times, counted as 0")
        )
    held = [h for h in w.param_holders if h.name in set(config.offload)]
    if held:
        moved = sum(2 * h.param_bytes + h.grad_bytes for h in held) * config.accumulation
        out["parameter_offload"] = _transfer_ms(w, moved, target, basis, "parameter_offload")
        assumptions.append(
            "offloaded parameters cross the host link twice per micro-batch (forward and backward) and "
            "their gradients once, not overlapped with compute (an upper bound)"
        )
    if config.attention == "sdpa":
        out["attention"] = 0.0
        basis["attention"] = "assumption: SDPA is no slower than eager attention (often faster; not counted)"
    if config.allocator == "expandable":
        out["allocator"] = 0.0
        basis["allocator"] = "assumption: expandable segments cost no time"


def _transfer_ms(w: Workload, nbytes: float, target: _Link, basis: dict[str, str], part: str) -> float | None:
    rate = target.rate or w.offload_bytes_per_s
    if not rate:
        basis[part] = "unknown: no host-link bandwidth measured and no card named"
        return None
    measured = target.rate is None or target.rate == w.offload_bytes_per_s
    basis[part] = (
        f"measured pinned host<->device bandwidth ({rate / 1e9:.1f} GB/s)"
        if measured
        else f"the target card's PCIe datasheet rate x efficiency ({rate / 1e9:.1f} GB/s)"
    )
    return 1e3 * nbytes / rate


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


def _amp_ms(
    w: Workload, config: Config, target: _Link, assumptions: list[str], basis: dict[str, str]
) -> float | None:
    native = w.bf16_native if target.bf16 is None else target.bf16
    if w.fwd_bwd_ms is None:
        basis["autocast"] = "unknown: no forward/backward time measured"
        return None
    if config.precision == "bf16" and not native:
        assumptions.append("bf16 without native support runs no faster (emulated); counted as no change")
        basis["autocast"] = "device capability: no native bf16, no speed-up"
        return 0.0
    factor, why = amp_time_factor(w, config.precision, target.card)
    basis["autocast"] = why
    assumptions.append(f"autocast runs forward+backward in {factor:.0%} of the fp32 time ({why})")
    return w.fwd_bwd_ms * (factor - 1.0)


def amp_time_factor(w: Workload, precision: str, card: str | None = None) -> tuple[float, str]:
    """Forward+backward time under autocast as a fraction of fp32's, and what it rests on.

    From the device's capabilities where the trace measured them: the share of forward+backward the
    measured FLOPs need at the profiled GPU's fp32 datasheet peak (``peak_fraction``) is the matmul
    time; it shrinks by the datasheet 16-bit / fp32 peak ratio of the target card (else the profiled
    GPU), at ``AMP_TENSOR_EFFICIENCY`` of the 16-bit peak; the rest runs in ``AMP_OTHER_TIME_FACTOR``
    of its time. Without a FLOP count or a known device: the flat factor by compute class."""
    from memdoctor.cards import device_peaks

    found = device_peaks(card or w.device_name)
    dtype = "bfloat16" if precision == "bf16" else "float16"
    if found and dtype in found[1] and w.peak_fraction and w.fwd_bwd_ms and w.step_ms:
        key, peaks = found
        share = min(1.0, w.peak_fraction * w.step_ms / w.fwd_bwd_ms)
        speedup = peaks[dtype] / peaks["float32"] * AMP_TENSOR_EFFICIENCY
        factor = min(1.0, share / max(speedup, 1.0) + (1.0 - share) * AMP_OTHER_TIME_FACTOR)
        return factor, (
            f"device capabilities: {key} datasheet {dtype} {peaks[dtype] / 1e12:.0f} vs fp32 "
            f"{peaks['float32'] / 1e12:.0f} TFLOP/s at {AMP_TENSOR_EFFICIENCY:.0%} efficiency, matmul share "
            f"{share:.0%} of forward+backward from the measured FLOP rate; the rest x{AMP_OTHER_TIME_FACTOR}"
        )
    factor = AMP_TIME_FACTOR[w.compute_class]
    why = "compute class " + (w.compute_class or "not measured")
    return factor, f"flat factor by {why} (no FLOP count or no datasheet peaks for the device)"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
