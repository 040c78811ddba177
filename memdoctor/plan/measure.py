"""The calibration: a trace's measurements as a ``Workload`` (``measured_workload``). The measured peak
is split into what each lever acts on; what a trace did not measure is assumed and said so in the
workload's notes.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from memdoctor.analysis.layers import layer_table, outside_holders, repeated_blocks
from memdoctor.analysis.precision import already_half, measured_steps, module_precision
from memdoctor.analysis.steps import peak_step
from memdoctor.plan.candidates import candidates, extrapolate_blocks, param_holders, shard_blocks
from memdoctor.plan.comm import measured_link
from memdoctor.plan.memory import AMP_ACTIVATION_FACTOR
from memdoctor.plan.padding import padding_facts
from memdoctor.plan.parallel_fsdp import forward_end
from memdoctor.plan.splits import output_bytes, split_of
from memdoctor.plan.workload import Workload
from memdoctor.trace import Trace

# Modules whose weights autocast casts to a 16-bit copy for its matmuls (``AMP_WEIGHT_CACHE_FACTOR``).
MATMUL_WEIGHT_TYPES = re.compile(r"Linear|Conv|Attention|MLP|LSTM|GRU|RNN|Bilinear", re.I)
# What adding autocast multiplies a module type's own saved activations by, on the device type autocast
# runs on ("*": every device): (type pattern, device type, factor, why). Every other module's are stored
# in 16 bits (``AMP_ACTIVATION_FACTOR``). Measured by ``benchmarks/amp_whatif_check.py`` (BENCHMARKS.md,
# issue 15): CPU and an H200, fp32 against bf16 autocast, saved bytes per module type. Attention modules
# halve: right for fused attention (SDPA, the default of HF models and torch's own), which saves q, k, v,
# the output and a small log-sum-exp. Eager attention on CUDA keeps its softmax probabilities in fp32 and
# saves a 16-bit copy as well (7 of fp32's 9 bytes a score with dropout): under-predicted, and a trace
# does not say which attention ran (the recorded GPU traces' attention saves O(seq), i.e. fused).
AMP_FACTORS: tuple[tuple[re.Pattern[str], str, float, str], ...] = (
    (re.compile(r"Loss$", re.I), "*", 1.0, "losses autocast to fp32 on every device"),
    (re.compile(r"Embedding", re.I), "*", 1.0, "saves int64 indices; its output is fp32 (no matmul cast)"),
    (
        re.compile(r"^(?!.*Batch).*Norm", re.I),
        "*",
        1.0,
        "LayerNorm, GroupNorm, RMSNorm: fp32 on CUDA's list, and in a transformer their input is the fp32 "
        "residual stream (the embeddings' fp32 plus 16-bit outputs promotes to fp32) on CPU too",
    ),
    (re.compile(r"MaxPool", re.I), "*", 1.0, "saves int64 indices; its input is counted by the ReLU before"),
    (re.compile(r"Softmax", re.I), "cuda", 1.0, "softmax and log_softmax autocast to fp32 on CUDA (not CPU)"),
    (re.compile(r"Dropout", re.I), "cuda", 1.0, "CUDA's dropout saves a bool mask (CPU's: the input dtype)"),
    # Measured on the H200, GPT-2 small under the Trainer at b16 x 512, fp32 against bf16 autocast, both
    # uncapped (BENCHMARKS.md, "GPT-2's bf16 what-if"): taken as 0.5, GPT-2's bf16 was predicted 11.90 GB
    # against 13.32 measured, and the first-shot plan of bf16 alone ran out of memory under 8 GiB.
    (
        re.compile(r"^NewGELU", re.I),
        "cuda",
        0.88,
        "HF's tanh GELU (GPT-2) takes pow(x, 3), on CUDA autocast's fp32 list: most of what it saves "
        "stays fp32",
    ),
)
# HF's Conv1D (GPT-2's projections) saved 0.59 of its fp32 bytes under bf16, but that counts the 16-bit
# copy of its weight it saves for backward, which the plan counts as autocast's weight cache: without it,
# 0.500 (the two uncapped traces in tests/data), the default. Taken at 0.59, GPT-2's verified plan on the
# H100 counted the copies twice (0.17 GB).
# Code sites of eager attention's temporaries in the peak ledger (seq x seq scores and probabilities).
ATTENTION_SITE = re.compile(r"attention|attn|softmax|baddbmm|scaled_dot", re.I)
# Assumed optimizer state when the run died before its first optimizer step: AdamW's two fp32 moments.
ASSUMED_ADAM_STATE_FACTOR = 2.0


def measured_workload(trace: Trace, summary: dict[str, Any]) -> Workload | None:
    """The trace's measurements as a ``Workload``; None when no step has a memory figure."""
    cats = _with_ledger_gradients(summary)
    peak = summary.get("peak_memory_bytes")
    if not peak or cats.get("activations") is None or cats.get("parameters") is None:
        return None
    step = peak_step(trace)
    rows = layer_table(trace, step)
    outside = outside_holders(trace, step)
    notes: list[str] = []
    params = sum(r["param_bytes"] for r in rows)
    has_optimizer = (summary.get("steps_found") or {}).get("by") != "backward"
    grads, opt = _state(rows, params, notes, has_optimizer)
    accounted = sum(
        int(cats.get(c) or 0) for c in ("parameters", "gradients", "optimizer_state", "activations")
    )
    rest = max(0, int(peak) - accounted)
    temporaries = _temporaries(summary, rest, notes)
    complete = not summary.get("peak_from_incomplete_step")
    model, own = planned_model(trace, rows, notes)
    cands = candidates(trace, own, notes)
    pad, pad_why = padding_facts(trace, summary)
    amp_share, matmul_bytes = amp_figures(trace, summary, rows, notes, outside)
    script = summary.get("script_precision") or {}
    split = split_of(trace)
    if split.why_not:
        notes.append(split.why_not)
    names, units = shard_blocks(trace, notes)
    fwd_acts, fwd_grads = forward_end(trace)
    missing = 0
    if not complete:
        missing, extra = extrapolate_blocks(trace, own, notes)
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
        amp_share=amp_share,
        matmul_param_bytes=matmul_bytes,
        step_ms=_step_ms(summary),
        fwd_bwd_ms=_fwd_bwd_ms(summary)
        or _warmup_fwd_bwd(trace, notes)
        or (None if complete else _estimated_fwd_bwd(trace, rows, notes)),
        compute_class=(summary.get("compute") or {}).get("class"),
        batch_size=batch_size(summary),
        complete=complete,
        candidates=cands,
        offload_bytes_per_s=_offload_rate(summary),
        host_optimizer_bytes_per_s=_host(summary, "bytes_per_s"),
        host_threads=_host(summary, "threads"),
        device_kind=(summary.get("device") or {}).get("kind"),
        bf16_native=(summary.get("device") or {}).get("bf16_native"),
        precision_verdict=(summary.get("precision") or {}).get("verdict"),
        notes=notes,
        padding=pad,
        padding_unavailable=pad_why,
        attention_temporaries=attention_temporaries(summary, temporaries),
        param_holders=param_holders(own),
        device_name=_device_name(summary),
        peak_fraction=(summary.get("compute") or {}).get("peak_fraction"),
        scale_window_log2=_window(summary),
        suggested_scale_log2=(summary.get("precision") or {}).get("suggested_init_scale_log2"),
        shard_units=units,
        shard_names=names,
        forward_end_activations=fwd_acts,
        forward_end_gradients=fwd_grads,
        optimizer_ms=(summary.get("phases_ms") or {}).get("optimizer"),
        **measured_link(trace, summary),
        outside_bytes=_outside_bytes(outside, notes),
        root_output_bytes=output_bytes(trace, batch_size(summary)),
        script_autocast=script.get("autocast"),
        script_precision=script.get("text"),
        script_tf32=(script.get("tf32") or {}).get("matmul_tf32")
        if script.get("device_type") == "cuda"
        else None,
        split=split,
        has_optimizer=has_optimizer,
        optimizer_classes=tuple((summary.get("steps_found") or {}).get("optimizers") or ()),
        model=model,
        as_is_oom_budget=_died_under(summary, complete),
    )


def _died_under(summary: dict[str, Any], complete: bool) -> int | None:
    """The memory the script as it is ran out of, when it did so in the step its peak comes from: the
    budget it was profiled under, else the device's cap or size. Its planned peak is then a lower bound
    (the peak was never reached), and the unchanged config must never be the plan: the minimal GPT on
    the H200 died at 5.78 GiB of 8 in its logits upcast, and a plan of no levers "fit" at 7.25 GiB."""
    if complete or summary.get("status") != "oom":
        return None
    device = summary.get("device") or {}
    limits = (summary.get("budget_bytes"), device.get("memory_cap_bytes"), device.get("total_memory_bytes"))
    for value in limits:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def planned_model(
    trace: Trace, rows: list[dict[str, Any]], notes: list[str]
) -> tuple[int, list[dict[str, Any]]]:
    """The model whose modules the plan names, and its rows, named as in the model (without the
    ``modelN:`` prefix of the report's tables, so that ``memdoctor run`` finds them in it).

    A config names modules by their path in one model (``checkpoint``, ``offload_parameters``), and
    ``memdoctor run`` applies it to the model of that class (``provenance``): with several models (a
    GAN's generator and discriminator), the plan changes the one holding the most memory, activations
    and parameters together, and says so."""
    index = {info.index: info for info in trace.models}
    roots = [r for r in rows if r["depth"] == 0 and r["model"] in index]
    if not roots:
        return 0, rows
    best = max(
        roots, key=lambda r: ((r["activation_bytes"] or 0) + r["inclusive"]["parameters"], -r["model"])
    )
    model = int(best["model"])
    if len(roots) > 1:
        others = ", ".join(f"{index[r['model']].cls} (model {r['model']})" for r in roots if r is not best)
        notes.append(
            f"{len(roots)} models trained: the plan changes {index[model].cls} (model {model}), which holds "
            f"the most memory; {others} as profiled"
        )
    names = index[model].names
    return model, [{**r, "name": names[r["index"]]} for r in rows if r["model"] == model]


def attention_temporaries(summary: dict[str, Any], temporaries: int) -> int:
    """The peak ledger's temporaries allocated in attention code (eager attention's seq x seq scores)."""
    led = summary.get("peak_ledger") or {}
    found = sum(
        int(b)
        for s, b in led.get("temporaries_by_site") or []
        if ATTENTION_SITE.search(str(s)) and isinstance(b, (int, float))
    )
    return min(found, temporaries)


def _device_name(summary: dict[str, Any]) -> str | None:
    device = summary.get("device") or {}
    return device.get("name") if device.get("kind") == "cuda" else None


def _window(summary: dict[str, Any]) -> tuple[int, int] | None:
    window = (summary.get("precision") or {}).get("scale_window_log2")
    return (int(window[0]), int(window[1])) if isinstance(window, list) and len(window) == 2 else None


def _state(rows: list[dict[str, Any]], params: int, notes: list[str], has_optimizer: bool) -> tuple[int, int]:
    """All gradients and optimizer state, from the per-module columns; assumed when never measured
    (but none for a script without an optimizer)."""
    grads = sum(r["grad_bytes"] or 0 for r in rows)
    opt = sum(r["optimizer_state_bytes"] or 0 for r in rows)
    if grads == 0:
        grads = params
        notes.append("gradients not measured (no backward finished): assumed one per parameter byte")
    if opt == 0 and has_optimizer:
        opt = int(ASSUMED_ADAM_STATE_FACTOR * params)
        notes.append(
            "optimizer state not measured (no optimizer step ran): assumed AdamW, 2x the parameter bytes"
        )
    return grads, opt


def _with_ledger_gradients(summary: dict[str, Any]) -> dict[str, Any]:
    """The step's categories at the peak, with the gradients the peak ledger (every live tensor at the
    peak, from the allocator's history) counted there when they are more. A re-profile split by
    gradient accumulation dies in a later micro-batch with the earlier ones' gradients live; the step's
    categories put them in "other", so the plan counted them twice, as gradients and in the fixed rest
    (GPT-2 small's re-profile at 1/2 on the H100: 0.50 GB of 7.19 predicted, BENCHMARKS.md)."""
    cats = dict(summary.get("categories") or {})
    counted = _peak_ledger(summary, "gradients")
    if counted is not None:
        cats["gradients"] = max(int(cats.get("gradients") or 0), counted)
    return cats


def _peak_ledger(summary: dict[str, Any], category: str) -> int | None:
    """Bytes of ``category`` in the peak ledger, when it recorded the peak step (None otherwise)."""
    led = summary.get("peak_ledger") or {}
    found = (led.get("categories") or {}).get(category)
    if isinstance(found, (int, float)) and led.get("step") == summary.get("peak_step"):
        return int(found)
    return None


def _temporaries(summary: dict[str, Any], rest: int, notes: list[str]) -> int:
    """The batch-dependent part of the unaccounted rest: the peak ledger's temporaries when recorded;
    without a ledger the whole rest is kept fixed (it does not shrink with the batch: an upper bound)."""
    temp = _peak_ledger(summary, "temporaries")
    if temp is not None:
        return min(rest, temp)
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


def _outside_bytes(outside: list[dict[str, Any]], notes: list[str]) -> int:
    """What code outside every child module holds (saved and temporary), and a note naming its
    largest line: the plan keeps it under every lever but the micro-batch (and padding). What the
    root's code saves for backward is freed by each micro-batch's backward, even under a split inside
    the forward (what the forward returns is not: ``Workload.root_output_bytes``)."""
    total = sum(r["activation_bytes"] + r["temporary_bytes"] for r in outside)
    if total:
        top = outside[0]
        notes.append(
            f"{total} bytes are held outside every child module, the most by {top['name']} at "
            f"{top['site']}: they scale with the micro-batch; checkpointing and offload free none of them"
        )
    return total


def amp_factor(module_type: str | None, device_type: str | None) -> float:
    """What adding autocast multiplies a module's own saved activations by: ``AMP_ACTIVATION_FACTOR``
    unless ``AMP_FACTORS`` says otherwise for its type. Autocast casts only the inputs of its
    lower-precision ops (matmuls, convolutions) to 16 bits; the ops on neither of its lists (BatchNorm,
    ReLU, GELU, pooling, adds, dropout...) run in their input's dtype, so after a 16-bit matmul they save
    16-bit tensors too. Only the ops it promotes to fp32 (losses; on CUDA norms and softmax) and what
    follows an fp32 tensor up to the next matmul (an embedding's output, the residual stream) keep fp32.
    Checked against measured autocast runs, on CPU and an H200: ``benchmarks/amp_whatif_check.py``."""
    name = module_type or ""
    for pattern, where, factor, _why in AMP_FACTORS:
        if where in ("*", device_type) and pattern.search(name):
            return factor
    return AMP_ACTIVATION_FACTOR


def amp_figures(
    trace: Trace,
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    notes: list[str],
    outside: list[dict[str, Any]] | None = None,
) -> tuple[float, int]:
    """What adding autocast would act on: the share of the activations it would store in 16 bits (by
    module type, ``amp_factor``, of those still fp32) and the fp32 matmul weight bytes it would cache in
    16 bits. Modules the precision collector saw under the script's own autocast, or with 16-bit (or
    fp64, which autocast leaves alone) outputs, are left out; without that collector, fp32 is assumed and
    said. The loop's own saved tensors (a loss outside the model) and a root's own code (a logits upcast
    and its loss, in the shapes seen) count in the whole and are never halved: a loss autocasts to fp32."""
    script = summary.get("script_precision")
    cols = _precision_columns(trace)
    if script is None or not cols:
        notes.append(
            "the script's own precision was not measured (precision collector off): it is assumed to run "
            "in fp32, so autocast would halve the activations of every module it does not keep in fp32"
        )
        cols = {}
    params = (script or {}).get("parameter_bytes") or {}
    # only fp32 weights get a 16-bit copy; unmeasured parameters are taken as fp32
    fp32_share = params.get("float32", 0) / sum(params.values()) if sum(params.values()) else 1.0
    device_type = (script or {}).get("device_type") or trace.device.get("kind")
    total = sum(r["activation_bytes"] for r in outside or [] if r["holder"] == "loop")
    saved = weights = 0.0
    for r in rows:
        auto, out = cols.get((r["model"], r["index"]), (None, None))
        own = r["activation_self_bytes"] or 0
        total += own
        factor = 1.0 if r["index"] == 0 else amp_factor(r["type"], device_type)
        if not already_half(auto, out) and out in (None, 32):
            saved += own * (1.0 - factor)
        if MATMUL_WEIGHT_TYPES.search(r["type"] or "") and not already_half(auto, None):
            weights += r["param_bytes"] or 0
    # as the share of the whole that would be halved: the memory model's ``1 - share x (1 - factor)``
    share = saved / (total * (1.0 - AMP_ACTIVATION_FACTOR)) if total else 0.0
    return share, int(weights * fp32_share)


def _tf32(script: dict[str, Any]) -> bool | None:
    """Whether the script's fp32 matmuls may use TF32: on a CUDA run only (None: not measured)."""
    return (script.get("tf32") or {}).get("matmul_tf32") if script.get("device_type") == "cuda" else None


def _precision_columns(trace: Trace) -> dict[tuple[int, int], tuple[Any, Any]]:
    """(model, module) -> (autocast bits, output bits) of the peak step, else the last measured step."""
    step = peak_step(trace)
    candidates = [step] if step is not None else []
    candidates += list(reversed(measured_steps(trace)))
    for s in candidates:
        out: dict[tuple[int, int], tuple[Any, Any]] = {}
        for info in trace.models:
            autocast, output = module_precision(s, info.index)
            pairs = zip(autocast, output, strict=False)
            out.update({(info.index, i): pair for i, pair in enumerate(pairs)})
        if out:
            return out
    return {}


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


def batch_size(summary: dict[str, Any]) -> int | None:
    """The batch size of the largest measured batch: as measured along its batch dimension (not assumed
    to be dim 0: sequence-first batches), else (older traces) the first dimension its tensors share."""
    largest = (summary.get("data") or {}).get("largest_batch") or {}
    measured = largest.get("batch_size")
    if isinstance(measured, int) and measured > 0:
        return measured
    shapes = [v for v in (largest.get("shapes") or {}).values() if v]
    firsts = {v[0] for v in shapes}
    return firsts.pop() if len(firsts) == 1 and min(firsts) > 0 else None


def _host(summary: dict[str, Any], key: str) -> Any:
    """A field of the measured host optimizer rate (``device.host_optimizer``); None when not measured."""
    found = ((summary.get("device") or {}).get("host_optimizer") or {}).get(key)
    return found if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0 else None


def _offload_rate(summary: dict[str, Any]) -> float | None:
    bw = (summary.get("device") or {}).get("bandwidth") or {}
    found = [bw.get(k) for k in ("h2d_pinned_bytes_per_s", "d2h_pinned_bytes_per_s")]
    rates = [float(r) for r in found if isinstance(r, (int, float)) and r > 0]
    return min(rates) if rates else None
