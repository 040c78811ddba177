"""Compute intensity: FLOPs per step, bytes moved, arithmetic intensity and where the step sits on the
device's roofline (the nine-grid's "compute intensity" axis).

Reads the one step the ``flops`` collector measured (``step.collectors.flops``): FLOPs by torch's
counter, bytes as the sum of every op's tensor inputs and outputs. Kernels that fuse ops move less, so
the bytes are an upper bound and the arithmetic intensity (FLOPs / byte) a lower bound. The class
compares it with the device's ridge point, peak FLOP/s / memory bandwidth from the vendor's datasheet
(``memdoctor.cards``):

* ``low``: below a quarter of the ridge point, the step is memory-bound (bandwidth limits it);
* ``medium``: between a quarter of the ridge point and the ridge point;
* ``high``: at or above the ridge point, compute-bound: the step could saturate the arithmetic units.

Achieved FLOP/s divides the measured step's FLOPs by the median time of the other profiled steps (the
measured step ran under the counter, so its own time is perturbed); it assumes every step does the same
work, which holds for fixed shapes.
"""

from __future__ import annotations

import statistics
from typing import Any

from memdoctor.analysis.notes import collector_note
from memdoctor.cards import device_peaks
from memdoctor.trace import ModelInfo, StepRecord, Trace

NAME = "flops"
LOW_SHARE = 0.25  # below this share of the ridge point: memory-bound ("low")

# ----------------------------------------------------------------------------------------- the measured step


def flop_step(trace: Trace) -> StepRecord | None:
    """The step the flops collector measured (the last such record), or None."""
    found = [s for s in trace.steps if isinstance(s.collectors.get(NAME), dict)]
    return found[-1] if found else None


def not_measured_reason(trace: Trace) -> str:
    """Why a trace has no FLOP count, in one sentence for the report."""
    note = collector_note(trace.header.get("not_measured"), NAME)
    if note is not None:
        return note
    for event in trace.events:
        if event.get("kind") == "collector_failed" and f"the {NAME} collector" in str(event.get("message")):
            return str(event.get("message"))
    record = trace.collected.get(NAME) or {}
    if isinstance(record.get("not_measured"), str):
        return f"not measured in {record['not_measured']}"
    planned = record.get("measured_step")
    if planned is not None:
        return (
            f"step {planned}, the step chosen for counting, has no FLOP count (the run ended before it, "
            "or no module of the trained model ran in it)"
        )
    return "this trace has no FLOP count (recorded without the flops collector, or by an earlier memdoctor)"


def _num(obj: Any, key: str) -> float:
    value = obj.get(key) if isinstance(obj, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def totals(data: dict[str, Any]) -> dict[str, Any]:
    """FLOPs and bytes by phase, and the arithmetic intensity of the model's work (forward + backward:
    the optimizer's FLOPs count zero in torch's counter, and its bytes include memdoctor's own
    gradient-norm read)."""
    flops, nbytes = data.get("flops") or {}, data.get("bytes") or {}
    model_flops = _num(flops, "forward") + _num(flops, "backward")
    model_bytes = _num(nbytes, "forward") + _num(nbytes, "backward")
    return {
        "flops": {p: int(_num(flops, p)) for p in ("forward", "backward", "optimizer", "total")},
        "bytes": {p: int(_num(nbytes, p)) for p in ("forward", "backward", "optimizer", "total")},
        "arithmetic_intensity": model_flops / model_bytes if model_bytes else None,
    }


def _intensity(flops: Any, nbytes: Any) -> float | None:
    return float(flops) / float(nbytes) if flops is not None and nbytes else None


# ----------------------------------------------------------------------------------------- the device


def dominant_dtype(data: dict[str, Any]) -> str | None:
    """The dtype of most FLOPs (by the first tensor input of each counted op)."""
    by_dtype = data.get("flops_by_dtype") or {}
    counted = {k: v for k, v in by_dtype.items() if isinstance(v, (int, float)) and v > 0}
    return max(sorted(counted), key=lambda k: counted[k]) if counted else None


def roofline(trace: Trace, data: dict[str, Any]) -> dict[str, Any] | None:
    """The device's peak FLOP/s for the step's dominant dtype, its bandwidth and ridge point."""
    name = trace.device.get("name") if trace.device.get("kind") == "cuda" else None
    found = device_peaks(name)
    dtype = dominant_dtype(data) or "float32"
    if found is None or dtype not in found[1]:
        return None
    key, peaks = found
    return {
        "device": key,
        "dtype": dtype,
        "peak_flops_per_s": peaks[dtype],
        "bandwidth_bytes_per_s": peaks["bandwidth"],
        "ridge_point": peaks[dtype] / peaks["bandwidth"],
        "source": "vendor datasheet, dense",
    }


def intensity_class(intensity: float | None, roof: dict[str, Any] | None) -> tuple[str | None, str]:
    """``(low | medium | high | None, evidence)`` of the step's arithmetic intensity."""
    if intensity is None:
        return None, "no bytes were counted, so there is no arithmetic intensity"
    text = f"arithmetic intensity {intensity:.3g} FLOP/byte (a lower bound: bytes are unfused)"
    if roof is None:
        return None, f"{text}; unknown device: no peak FLOP/s and bandwidth to compare it with"
    ratio = intensity / roof["ridge_point"]
    cls = "high" if ratio >= 1 else "low" if ratio < LOW_SHARE else "medium"
    bound = {"high": "compute-bound", "medium": "between", "low": "memory-bound"}[cls]
    ridge = (
        f"the {roof['device']}'s ridge point {roof['ridge_point']:.3g} FLOP/byte "
        f"({roof['peak_flops_per_s'] / 1e12:.4g} TFLOP/s {roof['dtype']} / "
        f"{roof['bandwidth_bytes_per_s'] / 1e12:.3g} TB/s, {roof['source']})"
    )
    return cls, f"{text} is {ratio:.2f}x {ridge}: {bound}"


# ----------------------------------------------------------------------------------------- time


def unperturbed_step_ms(trace: Trace, measured: int) -> float | None:
    """Median duration of the complete profiled steps other than the one the counter ran on."""
    times = [s.duration_ms for s in trace.profiled_steps() if s.step != measured and s.duration_ms]
    return statistics.median(times) if times else None


# ----------------------------------------------------------------------------------------- per module


def module_flops(info: ModelInfo, step: StepRecord) -> tuple[list[Any], list[Any]]:
    """The measured step's inclusive ``flops`` and ``flop_bytes`` columns (None where absent)."""
    n = len(info.names)
    cols = step.modules.get(info.index) or {}

    def col(name: str) -> list[Any]:
        values = cols.get(name)
        return (list(values) + [None] * n)[:n] if isinstance(values, list) else [None] * n

    return col("flops"), col("flop_bytes")


def _own(info: ModelInfo, values: list[Any]) -> list[float | None]:
    """Exclusive figures from inclusive ones: a module's value less its children's."""
    own = [None if v is None else float(v) for v in values]
    for i, p in enumerate(info.parents):
        if p >= 0 and own[p] is not None and values[i] is not None:
            own[p] = max(0.0, own[p] - float(values[i]))  # type: ignore[operator]
    return own


def compute_modules(trace: Trace, step: StepRecord, total: float) -> list[dict[str, Any]]:
    """Modules that run FLOPs themselves (not only through submodules), most FLOPs first."""
    rows = []
    for info in trace.models:
        flops, nbytes = module_flops(info, step)
        own_f, own_b = _own(info, flops), _own(info, nbytes)
        prefix = f"[{info.index}] " if len(trace.models) > 1 else ""
        for i in range(len(info.names)):
            if not own_f[i]:
                continue
            rows.append(
                {
                    "name": prefix + info.display_name(i),
                    "type": info.types[i],
                    "own_flops": int(own_f[i] or 0),
                    "own_bytes": int(own_b[i] or 0),
                    "own_intensity": _intensity(own_f[i], own_b[i]),
                    "flops": flops[i],
                    "share": (own_f[i] or 0) / total if total else None,
                }
            )
    return sorted(rows, key=lambda r: (-r["own_flops"], r["name"]))


# ----------------------------------------------------------------------------------------- summary


def compute_summary(trace: Trace) -> dict[str, Any] | None:
    """The ``compute`` object of summary.json, or None where no step was counted."""
    step = flop_step(trace)
    if step is None:
        return None
    data = step.collectors[NAME]
    tot = totals(data)
    roof = roofline(trace, data)
    cls, evidence = intensity_class(tot["arithmetic_intensity"], roof)
    step_ms = unperturbed_step_ms(trace, step.step)
    achieved = tot["flops"]["total"] / (step_ms / 1e3) if step_ms else None
    return {
        "measured_step": step.step,
        "complete": bool(data.get("complete", True)),
        "error": data.get("error") if isinstance(data.get("error"), str) else None,
        "counter": data.get("counter"),
        **tot,
        "flops_by_dtype": data.get("flops_by_dtype") or {},
        "step_time_ms": step_ms,
        "achieved_flops_per_s": achieved,
        "peak_fraction": achieved / roof["peak_flops_per_s"] if achieved and roof else None,
        "roofline": roof,
        "class": cls,
        "evidence": evidence,
        "unattributed_flops": data.get("unattributed_flops"),
        "top_ops": [o for o in data.get("top_ops") or [] if isinstance(o, dict)],
    }


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``flops_per_step``, ``compute`` and per layer ``flops`` / ``arithmetic_intensity``."""
    compute = compute_summary(trace)
    summary["compute"] = compute
    complete = compute is not None and compute["complete"]
    summary["flops_per_step"] = compute["flops"]["total"] if compute is not None and complete else None
    step = flop_step(trace)
    layers = summary.get("layers") or []
    values: list[tuple[Any, Any]] = []
    for info in trace.models:
        if step is None:
            values += [(None, None)] * len(info.names)
            continue
        flops, nbytes = module_flops(info, step)
        values += [(f, _intensity(f, b)) for f, b in zip(flops, nbytes, strict=True)]
    for row, (flops_value, intensity) in zip(layers, values, strict=False):
        row["flops"] = flops_value
        row["arithmetic_intensity"] = intensity


def module_table(trace: Trace, compute: dict[str, Any]) -> list[dict[str, Any]]:
    """``compute_modules`` of the measured step, each module's share of the model's (forward +
    backward) FLOPs; empty where no step was counted."""
    step = flop_step(trace)
    if step is None:
        return []
    return compute_modules(trace, step, compute["flops"]["forward"] + compute["flops"]["backward"])
