"""The time model: the milliseconds each lever adds to the measured step (None where this trace cannot
say), and what each figure rests on (measured, datasheet or an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass

from memdoctor.analysis.flops import device_peaks
from memdoctor.plan.comm import collective_rate, moved_bytes
from memdoctor.plan.config import EXPANDABLE_SEGMENTS, Config
from memdoctor.plan.memory import ranks
from memdoctor.plan.workload import Candidate, Workload

# Time: the share of forward+backward time that does not shrink with a smaller micro-batch (kernel
# launches, fixed-size work), by the measured compute class; "unknown" when compute was not measured.
# Without a compute measurement the cost is unknown (and said so) rather than guessed.
ACCUMULATION_FIXED_SHARE: dict[str | None, float] = {"high": 0.12, "medium": 0.15, "low": 0.3}
# Time: forward+backward under autocast as a fraction of fp32, with tensor cores for the dtype.
AMP_TIME_FACTOR = {"high": 0.6, "medium": 0.8, "low": 0.95, None: 0.8}
# Time: autocast from the device's capabilities (``amp_time_factor``). 16-bit matmuls are assumed to
# reach this share of the datasheet tensor-core peak (fp32's own time is taken at 100% of its peak, a
# lower bound, so the 16-bit time is not flattered); the rest of forward+backward (elementwise, norms,
# casts) runs in this share of its fp32 time. Both assumptions to calibrate.
AMP_TENSOR_EFFICIENCY = 0.5
AMP_OTHER_TIME_FACTOR = 0.9
# Time: the host's optimizer step under full offload, in bytes of parameters + gradients + optimizer
# state stepped per second by torch's foreach AdamW on the CPU, where the profile did not measure the
# host (``device.host_optimizer``: measured only where full offload is plausible). Measured on the H200
# host's 16 cores at 9.98e9 and 11.4e9 B/s (17.6 GB of state; BENCHMARKS.md, "Full offload"): their
# mean. 2 shared cores of the development machine stepped 1.3e9 (a 20M-parameter AdamW step).
CPU_OPTIMIZER_BYTES_PER_S = 10.7e9
# Time: a script with TF32 on (measured by the precision collector) runs its fp32 matmuls on the tensor
# cores, at this share of the card's 16-bit dense peak (the TF32 rate is half the bf16/fp16 one on the
# A100, H100/H200 and the Ampere/Ada GeForce datasheets): autocast then gains far less than over fp32.
TF32_OVER_16BIT = 0.5


@dataclass(frozen=True)
class Link:
    """What the time model needs of the target: native bf16, host-link rate, card name."""

    bf16: bool | None
    rate: float | None
    card: str | None


def time_model(
    w: Workload,
    config: Config,
    chosen: list[Candidate],
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
) -> dict[str, float | None]:
    """Milliseconds each lever adds to the measured step (None: not known from this trace); ``basis``
    gets, per part, what its figure rests on (measured, datasheet or an assumption)."""
    out: dict[str, float | None] = {}
    if chosen:
        _recompute_ms(w, config, chosen, target, assumptions, basis, out)
    if config.accumulation_steps > 1:
        out["accumulation"] = _accumulation_ms(w, config, assumptions)
        basis["accumulation"] = "assumption: a fixed share per micro-batch by the measured compute class"
    if w.adds_autocast(config.precision):  # the script's own autocast costs nothing more
        out["autocast"] = _amp_ms(w, config, target, assumptions, basis)
    if config.optimizer == "offload":
        out["offload"] = _transfer_ms(w, w.gradients + w.parameters, target, basis, "offload")
        assumptions.append(
            "offload moves every gradient to the CPU and every parameter back each step; the CPU "
            "optimizer's own time is not modelled"
            + ("" if out["offload"] is not None else "; no host-link bandwidth known, so its cost is unknown")
        )
    _more_time(w, config, target, assumptions, basis, out)
    if config.full_offload:
        _full_offload_ms(w, config, target, assumptions, basis, out)
    if ranks(config) > 1:
        _parallel_ms(w, config, target, assumptions, basis, out)
    return out


def compute_factor(w: Workload, n: int) -> float:
    """A rank's forward+backward time over one process's, with the batch split over ``n`` ranks: the
    share of it that is fixed per micro-batch (``ACCUMULATION_FIXED_SHARE`` by the measured compute
    class) stays, the rest shrinks with the batch; fully linear (a lower bound on time) where the
    compute class was not measured."""
    share = ACCUMULATION_FIXED_SHARE.get(w.compute_class, 0.0)
    return share + (1.0 - share) / n


def _parallel_ms(
    w: Workload,
    config: Config,
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    """What spreading the step over the ranks changes: a rank's share of the batch (the compute-bound
    parts above shrink with it, ``compute_factor``), FSDP2's share of the optimizer step, and the
    collectives (``memdoctor.plan.comm``), not overlapped with compute (an upper bound: DDP overlaps
    its all-reduce with backward, FSDP2 prefetches; not calibrated)."""
    n = ranks(config)
    factor = compute_factor(w, n)
    for part in ("recompute", "autocast", "padding"):
        if out.get(part) is not None:
            out[part] = out[part] * factor  # type: ignore[operator]
    fixed = ACCUMULATION_FIXED_SHARE.get(w.compute_class)
    how = (
        f"{fixed:.0%} of it fixed per micro-batch (compute class {w.compute_class})"
        if fixed is not None
        else "compute class not measured: taken as linear in the batch (a lower bound on time)"
    )
    out["data_parallel"] = None if w.fwd_bwd_ms is None else w.fwd_bwd_ms * (factor - 1.0)
    basis["data_parallel"] = (
        f"assumption: a rank computes 1/{n} of the batch; forward+backward x{factor:.2f}, {how}"
        if w.fwd_bwd_ms is not None
        else "unknown: no forward/backward time measured"
    )
    if config.parallel != "ddp" and not config.full_offload and w.optimizer_ms:
        out["sharded_optimizer"] = w.optimizer_ms * (1.0 / n - 1.0)
        basis["sharded_optimizer"] = (
            f"measured optimizer phase ({w.optimizer_ms:.1f} ms), 1/{n} of it per rank"
        )
    _communication_ms(w, config, target, assumptions, basis, out)


def _communication_ms(
    w: Workload,
    config: Config,
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    moved = moved_bytes(w, config)
    rate = collective_rate(w, target.card)
    total = sum(moved.values())
    ops = ", ".join(f"{op.replace('_', '-')} {b / 1e9:.3f} GB" for op, b in moved.items())
    if rate is None:
        out["communication"] = None
        basis["communication"] = f"unknown: no link rate measured or known ({ops} a step)"
        return
    out["communication"] = 1e3 * total / rate[0]
    basis["communication"] = f"{rate[1]}; {ops} a step over each rank's link"
    assumptions.append(
        f"communication ({ops} a step) not overlapped with compute (an upper bound; DDP overlaps its "
        "all-reduce with backward and FSDP2 prefetches, not calibrated)"
    )


def _recompute_ms(
    w: Workload,
    config: Config,
    chosen: list[Candidate],
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    """A checkpointed module's forward runs again in backward, under the plan's precision: the
    measured forward time, scaled by the autocast time factor where the plan adds autocast (the
    recomputation runs in 16 bits too; on the H200 an fp32-timed recompute overstated it ~2x and made
    a host copy of parameters look cheaper than one more checkpointed layer)."""
    measured = sum(c.forward_ms for c in chosen)
    if w.adds_autocast(config.precision) and not (config.precision == "bf16" and _no_native_bf16(w, target)):
        factor, why = amp_time_factor(w, config.precision, target.card)
        out["recompute"] = measured * factor
        basis["recompute"] = (
            f"measured forward time of each checkpointed module x{factor:.2f} under autocast ({why})"
        )
    else:
        out["recompute"] = measured
        basis["recompute"] = "measured: the forward time of each checkpointed module"
    assumptions.append(
        "recomputation costs the forward time of each checkpointed module, at the plan's precision"
    )


def _no_native_bf16(w: Workload, target: Link) -> bool:
    return not (w.bf16_native if target.bf16 is None else target.bf16)


def _full_offload_ms(
    w: Workload,
    config: Config,
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    """Full offload's two costs: the host link (per micro-batch, each shard unit's parameters come in
    for forward and again for backward, the root's once, and every gradient goes out) and the optimizer
    step on the host (at the rate the profile measured on this host, else ``CPU_OPTIMIZER_BYTES_PER_S``)."""
    units = sum(w.shard_units)
    root = max(0, w.parameters - units)
    n = ranks(config)
    moved = (2 * units + root + w.gradients) * config.accumulation_steps / n
    out["full_offload_transfers"] = _transfer_ms(w, moved, target, basis, "full_offload_transfers")
    assumptions.append(
        "full offload copies each shard unit's parameters to the device twice per micro-batch (forward "
        "and backward), the root's once, and every gradient back, not overlapped with compute (an upper "
        "bound: FSDP2 prefetches the next unit while one runs)"
        + (f"; each of the {n} ranks copies its 1/{n} shard" if n > 1 else "")
    )
    stepped = w.parameters + w.gradients + w.optimizer_state
    rate = w.host_optimizer_bytes_per_s or CPU_OPTIMIZER_BYTES_PER_S
    out["cpu_optimizer"] = 1e3 * stepped / rate
    how = (
        f"measured: a foreach AdamW step on this host's {w.host_threads or '?'} CPU threads"
        if w.host_optimizer_bytes_per_s
        else "assumption: the H200 host's measured rate (16 cores; the profile did not measure this host)"
    )
    basis["cpu_optimizer"] = (
        f"{how}; the optimizer steps {stepped / 1e9:.2f} GB of parameters, gradients and state on the host "
        f"at {rate / 1e9:.1f} GB/s (the device's own step is not subtracted)"
        + ("; the ranks share the host's cores: no faster than one process" if n > 1 else "")
    )
    assumptions.append(basis["cpu_optimizer"])


def _more_time(
    w: Workload,
    config: Config,
    target: Link,
    assumptions: list[str],
    basis: dict[str, str],
    out: dict[str, float | None],
) -> None:
    """The time of the padding, parameter-offload, attention and allocator levers."""
    if config.padding != "as-is" and w.padding is not None:
        mean = w.padding.mean_ratio(config.padding, config.multiple())
        out["padding"] = (mean - 1.0) * w.fwd_bwd_ms if w.fwd_bwd_ms else 0.0
        basis["padding"] = (
            f"measured lengths: the mean batch would be {mean:.0%} as long; forward+backward time assumed "
            "linear in the length" + ("" if w.fwd_bwd_ms else "; no phase times, counted as 0")
        )
    held = [h for h in w.param_holders if h.name in set(config.offload_parameters)]
    if held:
        moved = sum(2 * h.param_bytes + h.grad_bytes for h in held) * config.accumulation_steps
        out["parameter_offload"] = _transfer_ms(w, moved, target, basis, "parameter_offload")
        assumptions.append(
            "offloaded parameters cross the host link twice per micro-batch (forward and backward) and "
            "their gradients once, not overlapped with compute (an upper bound)"
        )
    if config.attention == "sdpa":
        out["attention"] = 0.0
        basis["attention"] = "assumption: SDPA is no slower than eager attention (often faster; not counted)"
    if config.allocator == EXPANDABLE_SEGMENTS:
        out["allocator"] = 0.0
        basis["allocator"] = "assumption: expandable segments cost no time"


def _transfer_ms(w: Workload, nbytes: float, target: Link, basis: dict[str, str], part: str) -> float | None:
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
    return w.fwd_bwd_ms * share * (config.accumulation_steps - 1)


def _amp_ms(
    w: Workload, config: Config, target: Link, assumptions: list[str], basis: dict[str, str]
) -> float | None:
    if w.fwd_bwd_ms is None:
        basis["autocast"] = "unknown: no forward/backward time measured"
        return None
    if config.precision == "bf16" and _no_native_bf16(w, target):
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
    measured FLOPs need at the profiled GPU's fp32 matmul rate (``peak_fraction`` is relative to its
    datasheet peak) is the matmul time. For a named ``card`` (``--gpu``) that share is re-weighed for
    the card: its matmul time scales by the two cards' fp32 matmul rates, the rest (elementwise, norms:
    memory-bound) by their memory bandwidths, so a card slow at fp32 (the RTX 2070: 7.5 TFLOP/s against
    the H200's 67) spends more of its step in matmuls, which 16 bits speed up. The matmul time shrinks
    by the card's datasheet 16-bit / fp32 rate at ``AMP_TENSOR_EFFICIENCY``; the rest runs in
    ``AMP_OTHER_TIME_FACTOR`` of its time. Without a FLOP count or a known device: the flat factor by
    compute class."""
    profiled = device_peaks(w.device_name)
    found = device_peaks(card) if card else profiled
    dtype = "bfloat16" if precision == "bf16" else "float16"
    if profiled and found and dtype in found[1] and w.peak_fraction and w.fwd_bwd_ms and w.step_ms:
        here, (key, peaks) = profiled[1], found
        here_base, _ = _fp32_matmul_peak(w, here, dtype)
        share = min(1.0, w.peak_fraction * here["float32"] / here_base * w.step_ms / w.fwd_bwd_ms)
        base, what = _fp32_matmul_peak(w, peaks, dtype)
        moved = ""
        if key != profiled[0]:
            matmul = share * here_base / base
            rest = (1.0 - share) * here["bandwidth"] / peaks["bandwidth"]
            share = matmul / (matmul + rest) if matmul + rest else share
            moved = f" re-weighed from the profiled {profiled[0]} by fp32 rate and memory bandwidth"
        speedup = peaks[dtype] / base * AMP_TENSOR_EFFICIENCY
        factor = min(1.0, share / max(speedup, 1.0) + (1.0 - share) * AMP_OTHER_TIME_FACTOR)
        return factor, (
            f"device capabilities: {key} datasheet {dtype} {peaks[dtype] / 1e12:.0f} vs {what} "
            f"{base / 1e12:.0f} TFLOP/s at {AMP_TENSOR_EFFICIENCY:.0%} efficiency, matmul share "
            f"{share:.0%} of forward+backward from the measured FLOP rate{moved}; the rest "
            f"x{AMP_OTHER_TIME_FACTOR}"
        )
    factor = AMP_TIME_FACTOR[w.compute_class]
    why = "compute class " + (w.compute_class or "not measured")
    return factor, f"flat factor by {why} (no FLOP count or no datasheet peaks for the device)"


def _fp32_matmul_peak(w: Workload, peaks: dict[str, float], dtype: str) -> tuple[float, str]:
    """The rate the script's fp32 matmuls run at on a card: the fp32 datasheet peak, or with TF32 on
    (on a card with bf16, i.e. tensor cores that do TF32) ``TF32_OVER_16BIT`` of its 16-bit peak."""
    if w.script_tf32 and "bfloat16" in peaks:
        return max(peaks["float32"], peaks[dtype] * TF32_OVER_16BIT), "TF32 (on in the script)"
    return peaks["float32"], "fp32"
