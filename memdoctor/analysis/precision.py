"""The precision the script itself runs in, from the ``precision`` collector (``capture/precision.py``):
its own autocast (in force during how many module forwards, in which dtype), its parameter and
activation dtypes, a GradScaler, and TF32. ``summary.json``'s ``script_precision``; the planner
(``memdoctor.plan.measure``) starts its what-if from it instead of assuming fp32.
"""

from __future__ import annotations

from typing import Any

from memdoctor.trace import StepRecord, Trace

NAME = "precision"
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
HALF = ("bfloat16", "float16")
HALF_BITS = 16
# The script "runs under its own autocast" when at least this share of its module forwards did.
AUTOCAST_MAJORITY = 0.5
# TF32 for fp32 matmuls: what torch.get_float32_matmul_precision() says when it is allowed.
TF32_MATMUL_PRECISIONS = ("high", "medium")


def short(dtype: str) -> str:
    return SHORT.get(dtype, dtype)


def measured_steps(trace: Trace) -> list[StepRecord]:
    """The steps the precision collector measured: the profiled ones, else the warm-up ones."""
    steps = [s for s in trace.steps if isinstance(s.collectors.get(NAME), dict)]
    return [s for s in steps if not s.warmup] or steps


def module_precision(step: StepRecord | None, model: int) -> tuple[list[Any], list[Any]]:
    """``(autocast_bits, output_bits)`` columns of ``model`` in ``step`` (empty where not measured)."""
    cols = (step.modules.get(model) if step is not None else None) or {}
    return list(cols.get("autocast_bits") or []), list(cols.get("output_bits") or [])


def already_half(autocast_bits: Any, output_bits: Any) -> bool:
    """Whether a module's activations are already 16-bit (or narrower): it ran under a 16-bit
    autocast, or its output is 16-bit."""
    return any(isinstance(b, (int, float)) and 0 < b <= HALF_BITS for b in (autocast_bits, output_bits))


def script_precision(trace: Trace) -> dict[str, Any] | None:
    """What precision the script runs in; None where the precision collector measured no step."""
    steps = measured_steps(trace)
    if not steps:
        return None
    fields = [s.collectors[NAME] for s in steps]
    forwards = sum(int(f.get("forwards") or 0) for f in fields)
    auto = _sum_dicts(f.get("autocast_forwards") for f in fields)
    share = sum(auto.values()) / forwards if forwards else 0.0
    dominant = max(auto, key=lambda k: auto[k]) if auto else None
    autocast = short(dominant) if dominant and share >= AUTOCAST_MAJORITY else None
    last = fields[-1]
    params = {k: int(v) for k, v in (last.get("parameter_bytes") or {}).items()}
    outputs = _sum_dicts([last.get("output_bytes")])  # one step's module outputs
    out_total = sum(outputs.values())
    out = {
        "device_type": last.get("device_type"),
        "autocast": autocast,
        "autocast_share": round(share, 4),
        "autocast_forwards": auto,
        "module_forwards": forwards,
        "parameters": dtype_label(params),
        "parameter_bytes": params,
        "activation_bytes": outputs,
        "activation_16bit_share": round(sum(outputs.get(d, 0) for d in HALF) / out_total, 4)
        if out_total
        else None,
        "grad_scaler": any(s.grad_scaler for s in trace.steps),
        "tf32": tf32_state(last.get("tf32") or {}),
    }
    applied = (trace.header.get("applied_config") or {}).get("precision")
    out["applied_autocast"] = applied if applied in ("bf16", "fp16") else None
    out["text"] = describe(out)
    return out


def dtype_label(by_dtype: dict[str, int]) -> str | None:
    """``fp32``, or ``mixed (fp32 75%, bf16 25%)`` by bytes; None for no floating parameters."""
    total = sum(by_dtype.values())
    if not total:
        return None
    ranked = sorted(by_dtype.items(), key=lambda kv: -kv[1])
    if len(ranked) == 1:
        return short(ranked[0][0])
    parts = ", ".join(f"{short(k)} {100 * v / total:.0f}%" for k, v in ranked)
    return f"mixed ({parts})"


def tf32_state(raw: dict[str, Any]) -> dict[str, Any]:
    """The recorded switches, and whether fp32 matmuls and cuDNN convolutions may use TF32."""
    precision = raw.get("float32_matmul_precision")
    matmul = raw.get("matmul")
    if precision in TF32_MATMUL_PRECISIONS:
        matmul = True
    return {**raw, "matmul_tf32": matmul, "cudnn_tf32": raw.get("cudnn")}


def describe(p: dict[str, Any]) -> str:
    """One line: "runs under its own bf16 autocast (100% of module forwards); parameters fp32; ..."."""
    share = f"{p['autocast_share']:.0%} of module forwards"
    if p["autocast"] and p.get("applied_autocast"):
        parts = [f"runs under {p['autocast']} autocast ({share}; memdoctor's applied config asks for it)"]
    elif p["autocast"]:
        parts = [f"runs under its own {p['autocast']} autocast ({share})"]
    elif p["autocast_share"]:
        parts = [f"runs mostly without autocast (autocast in {share})"]
    else:
        parts = ["runs without autocast"]
    if p["parameters"]:
        parts.append(f"parameters {p['parameters']}")
    acts = p["activation_bytes"]
    if acts:
        parts.append(f"module outputs {dtype_label(acts)}")
    if p["grad_scaler"]:
        parts.append("GradScaler in use")
    if p["device_type"] == "cuda":
        parts.append(_tf32_text(p["tf32"]))
    return "; ".join(parts)


def _tf32_text(tf32: dict[str, Any]) -> str:
    matmul, cudnn = tf32.get("matmul_tf32"), tf32.get("cudnn_tf32")
    if matmul and cudnn:
        return "TF32 on (matmuls and cuDNN)"
    if matmul:
        return "TF32 on for matmuls (not cuDNN)"
    if cudnn:
        return "TF32 on for cuDNN convolutions only (fp32 matmuls stay fp32)"
    return "TF32 off"


def _sum_dicts(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            out[k] = out.get(k, 0) + int(v)
    return dict(sorted(out.items()))


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``script_precision``: null where the precision collector did not run."""
    summary["script_precision"] = script_precision(trace)
