"""The memory model: the peak of a training step under a ``Config``, part by part, from a ``Workload``.
The unchanged config predicts exactly the measured peak (the calibration point). Every factor that is
an assumption rather than a measurement is a named constant here, listed in ``docs/planner.md``, to be
calibrated on the GPU by ``benchmarks/plan_accuracy.py``.
"""

from __future__ import annotations

from memdoctor.plan.config import EXPANDABLE_SEGMENTS, Config
from memdoctor.plan.workload import Candidate, Workload

# Autocast (bf16/fp16): the activations of every module but those it keeps in fp32 are stored in 16 bits,
# half of fp32: matmul inputs are cast, and the ops on neither of its lists (BatchNorm, activations,
# pooling, dropout) run in the dtype they are given. Which modules keep fp32 (losses, norms other than
# BatchNorm, embeddings; softmax on CUDA) is ``memdoctor.plan.measure.AMP_FACTORS``, measured.
AMP_ACTIVATION_FACTOR = 0.5


# Autocast caches a 16-bit copy of each matmul weight for the forward: + half the fp32 weight bytes.
AMP_WEIGHT_CACHE_FACTOR = 0.5
# 8-bit Adam-style optimizers (bitsandbytes) keep the two moments in 8 bits instead of 32: state / 4.
EIGHT_BIT_STATE_FACTOR = 0.25


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
# Reserved / allocated under full offload (FSDP2 + CPUOffloadPolicy) with expandable segments: each
# unit's host copy, its gather and its 16-bit casts come and go in sizes that leave gaps. Measured 1.20 on
# the H200 (the 1.1B decoder's plan: 7.26 GB reserved over 6.05 GB allocated, 2026-12-04; 7.27 GB reserved
# the day before). With 1.075 assumed, the reserved figure was near only because the allocated one
# counted the gradients and autocast's cache together (``apart_under_full_offload``). One workload measured.
# Without expandable segments the slack they would shrink to it is taken (1 + 0.20 / EXPANDABLE_GAP_KEPT;
# not measured).
FULL_OFFLOAD_RESERVED_RATIO = 1.20


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
    scale = rank_share(w, config) / config.accumulation_steps
    if config.accumulation_steps > 1 or config.parallel is not None:
        assumptions.append("activations and temporaries scale linearly with the micro-batch size")
    seq = padding_scale(w, config, assumptions)
    amp = activation_scale(w, config) / scale / seq
    amp_assumption(w, config, assumptions)
    acts = w.activations * scale * amp * seq
    freed = sum(c.free_bytes for c in chosen) * scale * amp * seq
    recompute = max((c.free_bytes for c in chosen), default=0) * scale * amp * seq
    if chosen:
        assumptions.append(
            "checkpointing frees each chosen module's measured checkpoint_free_bytes (its inputs stay); "
            "the largest block's activations come back while it is recomputed in backward"
        )
    params, grads = offloaded_state(w, config, assumptions)
    alone = config.accumulation_steps == 1 and config.optimizer != "offload" and not config.full_offload
    if chosen and alone:  # checkpointing alone: the backward peak holds a share of the gradients
        grads = checkpointed_gradients(grads, config)
        assumptions.append(
            f"with checkpointing alone the backward peak holds {CHECKPOINT_GRADIENT_SHARE:.0%} of the "
            "gradients (it comes mid-backward; calibrated on the GPU)"
        )
    parts = {
        "parameters": params,
        "gradients": grads,
        "optimizer_state": optimizer_bytes(w, config, assumptions),
        "activations": int(max(0.0, acts - freed) + recompute),
        # What code outside every child module holds (``w.outside_bytes``: a root's own logits upcast and
        # loss, the loop's loss) is in the activations and temporaries: it shrinks with the micro-batch
        # alone; no checkpoint candidate holds it and offload does not move it.
        "temporaries": int(_temporaries_left(w, config, assumptions) * scale * seq),
        "fixed": w.fixed,
        "autocast_weight_cache": int(w.matmul_param_bytes * AMP_WEIGHT_CACHE_FACTOR)
        if w.adds_autocast(config.precision)
        else 0,
    }
    if config.full_offload:
        apart_under_full_offload(parts, assumptions)
    joined = joined_outputs(w, config, assumptions)
    if joined:
        parts["joined_outputs"] = joined
    return parts


# The earlier micro-batches' outputs a split inside the forward joins back for the script, at most (the
# same as ``memdoctor.levers.microbatch.MAX_KEPT_BYTES``; a test keeps them equal): larger ones are
# dropped when its forward returns, and the script gets the last micro-batch's.
KEPT_OUTPUT_BYTES = 256 << 20


def joined_outputs(w: Workload, config: Config, assumptions: list[str]) -> int:
    """What a split inside the forward holds beyond its micro-batch's share of the forward's outputs
    (``held_outputs``), where it applies: ``config`` splits the batch in the forward."""
    k = config.accumulation_steps
    if k == 1 or w.split.kind != "forward" or not w.root_output_bytes:
        return 0
    outputs = int(w.root_output_bytes * rank_share(w, config))  # a rank's share of the batch's outputs
    held = int(held_outputs(outputs, k) * padding_scale(w, config))
    kept = (
        "joined back for the script, into its backward"
        if joined_back(w.root_output_bytes, k)
        else "dropped before its backward, where the gradient of the last one's takes their place"
    )
    assumptions.append(
        f"the split inside the forward keeps the earlier {k - 1} micro-batches' outputs (of "
        f"{outputs} bytes besides the loss for the whole batch) while the last one runs, "
        f"{kept}: {held} bytes more at the peak (at their measured dtype: an upper bound where "
        "autocast is added)"
    )
    return held


def joined_back(outputs: int, k: int) -> bool:
    """Whether the split inside the forward joins the earlier micro-batches' outputs back (small ones)."""
    return outputs * (k - 1) // k <= KEPT_OUTPUT_BYTES


def held_outputs(outputs: int, k: int) -> int:
    """Bytes a split inside the forward into ``k`` holds at its peak beyond one micro-batch's share of
    the forward's ``outputs`` (the whole batch's), which the scaled temporaries already count.

    Why: ``memdoctor.levers.microbatch`` keeps the earlier micro-batches' outputs while the last one runs
    (a language model's logits), so they do not shrink with the micro-batch as the rest does. Joined
    back (``joined_back``), the whole batch's stay into the script's backward: ``(k-1)/k`` more. Dropped
    (larger ones), they are gone before the backward, which holds the gradient of the last micro-batch's
    outputs instead, the size of its outputs: ``(k-2)/k`` more at the peak (none at k = 2). Measured on
    the H200 (``benchmarks/forward_split_check.sh``): the minimal GPT's bf16 logits (1.24 GB for 12 x
    1024 tokens) added 0.01, 0.41 and 0.63 GB to the peak of its own loop over 2, 3 and 4
    micro-batches; (k-2)/k of them is 0, 0.41 and 0.62 (with (k-1)/k the plan at k = 2 was 5.4% over);
    scaled with the micro-batch as before, its forward split was 1.6, 8.4 and 13.3% under-predicted."""
    if k <= 1:
        return 0
    return outputs * (k - 1) // k if joined_back(outputs, k) else outputs * (k - 2) // k


def amp_assumption(w: Workload, config: Config, assumptions: list[str]) -> None:
    """What the prediction takes autocast to change, starting from the script's own precision."""
    if config.precision == "fp32":
        return
    if not w.adds_autocast(config.precision):
        assumptions.append(
            f"the script already runs under its own {w.script_autocast} autocast, which is kept: "
            f"precision {config.precision} changes nothing here"
        )
        return
    start = f"measured: {w.script_precision}" if w.script_precision else "assumed fp32 (not measured)"
    assumptions.append(
        f"autocast stores {100 * w.amp_share:.0f}% of the activations in 16 bits (those of every module "
        "still in fp32 but losses, embeddings, norms other than BatchNorm, and on CUDA softmax and dropout); "
        f"the script as profiled {start}; fp32 master weights and optimizer state stay"
    )


def activation_scale(w: Workload, config: Config) -> float:
    """What the micro-batch, the padding policy and autocast multiply the measured activations by."""
    amp = 1.0 - w.amp_share * (1.0 - AMP_ACTIVATION_FACTOR) if w.adds_autocast(config.precision) else 1.0
    return amp * padding_scale(w, config) * rank_share(w, config) / config.accumulation_steps


def ranks(config: Config) -> int:
    """The processes ``config`` spreads the step over: ``gpus`` with a parallel engine, else 1."""
    return config.gpus if config.parallel is not None and config.gpus > 1 else 1


def rank_share(w: Workload, config: Config) -> float:
    """The share of the measured batch one rank computes: the global batch is split over the ranks (the
    same effective batch; memdoctor run splits each batch, keeping the script's optimizer-step count),
    so a rank's batch is ceil(B / N) of the measured B (1/N where B was not measured)."""
    n = ranks(config)
    if n == 1:
        return 1.0
    if w.batch_size:
        return -(-w.batch_size // n) / w.batch_size
    return 1.0 / n


def padding_scale(w: Workload, config: Config, assumptions: list[str] | None = None) -> float:
    """Padded length of the largest measured batch under the policy / as profiled (1: unchanged)."""
    if config.padding == "as-is" or w.padding is None:
        return 1.0
    ratio = w.padding.ratio(config.padding, config.multiple())
    if assumptions is not None:
        assumptions.append(
            f"padding policy {config.padding}: the largest measured batch would be padded to "
            f"{w.padding.length(config.padding, w.padding.worst_longest, config.multiple())} of "
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
    if config.full_offload:
        return full_offload_state(w, assumptions)
    held = [h for h in w.param_holders if h.name in set(config.offload_parameters)]
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


# Full offload (FSDP2 fully_shard + CPUOffloadPolicy): how many units' unsharded parameters, and
# gradients, the device holds at once besides the root's: the one computing and the next, prefetched in
# forward and backward (parameters); the one whose gradients are made and its reduce-scatter output
# before the copy to the host (gradients). An assumption to calibrate on the GPU.
FULL_OFFLOAD_UNITS_HELD = 2


def full_offload_state(w: Workload, assumptions: list[str]) -> tuple[int, int]:
    """Parameters and gradients on the device under full offload: the root's own unit (FSDP2 keeps the
    root gathered from its forward to the end of its backward, and its gradients until then) and
    ``FULL_OFFLOAD_UNITS_HELD`` of the largest shard unit; everything else is on the host."""
    units = w.shard_units
    largest = max(units, default=0)
    root = max(0, w.parameters - sum(units))
    held = root + FULL_OFFLOAD_UNITS_HELD * largest
    assumptions.append(
        f"full offload (FSDP2, CPU offload): the device holds the root's own parameters and gradients "
        f"({root} bytes) and {FULL_OFFLOAD_UNITS_HELD} of the largest of {len(units)} shard units "
        f"({largest} bytes each: the one running and the next, prefetched); optimizer state and the rest "
        "on the host; one model sharded (an assumption to calibrate)"
    )
    grads = round(held * w.gradients / w.parameters) if w.parameters else held
    return min(held, w.parameters), min(grads, w.gradients)


def apart_under_full_offload(parts: dict[str, int], assumptions: list[str]) -> None:
    """Under full offload autocast's 16-bit weight copies and the gradients are never on the device
    together: the cache lives through the forward and goes when the forward's autocast exits; the
    gradients come in the backward, each unit's copied to the host as it is made. The peak holds the
    larger of the two. Counting both over-predicted the 1.1B decoder's plan on the H200 by 0.88 GB of
    its 7.17 (allocated 6.05 GB measured; BENCHMARKS.md, issue 15)."""
    cache, grads = parts["autocast_weight_cache"], parts["gradients"]
    if not cache or not grads:
        return
    kept, dropped = (
        ("autocast_weight_cache", "gradients") if cache >= grads else ("gradients", "autocast_weight_cache")
    )
    parts[dropped] = 0
    assumptions.append(
        "full offload: autocast's 16-bit weight copies (forward only) and the device's gradients (backward "
        f"only) are never live together; the peak holds the larger, the {kept.replace('_', ' ')}"
    )


def optimizer_bytes(w: Workload, config: Config, assumptions: list[str]) -> int:
    if config.optimizer == "8bit":
        assumptions.append("8-bit optimizer: state / 4 (two 8-bit moments instead of two fp32 ones)")
        return int(w.optimizer_state * EIGHT_BIT_STATE_FACTOR)
    if config.optimizer == "offload" or config.full_offload:
        assumptions.append("optimizer state offloaded: none of it on the GPU (the step runs on the CPU)")
        return 0
    return w.optimizer_state


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


def checkpointed_gradients(grads: int, config: Config) -> int:
    """The gradient bytes at the backward peak of ``config`` with modules checkpointed: a share of them
    with checkpointing alone (the peak comes mid-backward), all of them with micro-batches, and all of
    them with the optimizer offloaded: without the optimizer step's own peak the backward's last blocks
    set it, when nearly every gradient exists (the 0.95B decoder's offload plan on the H200 peaked in
    block 1's backward holding 3.12 of its 3.06-3.5 GiB of gradients; BENCHMARKS.md, "Offload")."""
    if config.accumulation_steps == 1 and config.optimizer != "offload" and not config.full_offload:
        return int(grads * CHECKPOINT_GRADIENT_SHARE)
    return grads


def reserved_ratio(w: Workload, config: Config) -> float:
    """Reserved / allocated: as measured, at least the calibrated slack of a changed config, and shrunk
    toward 1 by expandable segments (an assumption); times a verified run's ``memory_correction``."""
    ratio = w.reserved_ratio
    if config != Config():
        ratio = max(ratio, CHECKPOINT_RESERVED_RATIO if config.checkpoint else CHANGED_RESERVED_RATIO)
    if config.full_offload:  # measured with expandable segments: the slack they shrink to it
        ratio = max(ratio, 1.0 + (FULL_OFFLOAD_RESERVED_RATIO - 1.0) / EXPANDABLE_GAP_KEPT)
    if config.allocator == EXPANDABLE_SEGMENTS:
        ratio = 1.0 + (ratio - 1.0) * EXPANDABLE_GAP_KEPT
    return ratio * w.memory_correction


def outermost(chosen: list[Candidate]) -> list[Candidate]:
    """A module inside another chosen one frees nothing more: its bytes are in its ancestor's."""
    keys = {c.key for c in chosen}
    return [c for c in chosen if not c.ancestors & keys]
