"""The activation and gradient histograms (``collectors.histograms``), read into one entry per module
and direction, and what ``summary.json`` and the report's precision section take from them.

Each module's output and output gradient are aggregated over every step that measured them (counts
summed, the absolute max the largest seen); ``precision_rules`` judges them.
"""

from __future__ import annotations

import math
from typing import Any

from memdoctor.analysis.gradnorms import scaler_skipped
from memdoctor.analysis.layers import depths, module_label
from memdoctor.analysis.precision_rules import (
    ASSUMED_SCALE_LOG2,
    FP16_TINY_LOG2,
    RULES,
    Entry,
    Evidence,
    verdict,
)
from memdoctor.trace import Trace

NAME = "histograms"
TABLE_ROWS = 12
MAX_CHART_LAYERS = 40
DIRECTIONS = ("forward", "backward")
COLUMNS = {
    "forward": ("fp16_overflow_fraction", "fp16_underflow_fraction"),
    "backward": ("grad_fp16_overflow_fraction", "grad_fp16_underflow_fraction"),
}


# ----------------------------------------------------------------------------------------- reading


def entries(trace: Trace) -> list[Entry]:
    """Every measured (module, direction), aggregated over the steps, in model then module order."""
    out: dict[tuple[int, int, str], Entry] = {}
    sizes = {m.index: len(m.names) for m in trace.models}
    for step in measured_steps(trace):
        shift = _scale_log2(step)
        for key, model in step.collectors[NAME]["models"].items():
            m = int(key)
            for direction in DIRECTIONS:
                cols = model.get(direction)
                if isinstance(cols, dict) and _valid(cols, sizes.get(m, 0)):
                    _add_step(trace, out, m, direction, cols, shift if direction == "backward" else None)
    order = {d: k for k, d in enumerate(DIRECTIONS)}
    found = sorted(out.values(), key=lambda e: (e.model, e.module, order[e.direction]))
    _mark_repeats(trace, found)
    return found


def _mark_repeats(trace: Trace, found: list[Entry]) -> None:
    """Set ``same_as`` on an entry whose figures equal those of one of its submodules."""
    groups: dict[tuple[Any, ...], list[Entry]] = {}
    for e in found:
        groups.setdefault((e.model, e.direction, e.signature()), []).append(e)
    parents = {info.index: info.parents for info in trace.models}
    for group in groups.values():
        for e in group:
            inner = [o for o in group if o is not e and _inside(parents[e.model], o.module, e.module)]
            if inner:
                e.same_as = max(inner, key=lambda o: o.module).name


def _inside(parents: list[int], module: int, ancestor: int) -> bool:
    while module > ancestor:
        module = parents[module]
    return module == ancestor


def measured_steps(trace: Trace) -> list[Any]:
    """Complete steps that carry histograms (warm-up steps too: an overflow there is as real), except
    those a GradScaler skipped (its scale was too high then: the gradients overflowed by design)."""
    return [
        s for s in trace.steps if s.complete and _has_data(s.collectors.get(NAME)) and not scaler_skipped(s)
    ]


def _scale_log2(step: Any) -> int | None:
    """log2 of the loss scale a GradScaler multiplied this step's gradients by (a power of two: its
    default init_scale 2**16, growth 2 and backoff 0.5), or None when none was recorded."""
    scale = (step.grad_scaler or {}).get("scale")
    return round(math.log2(scale)) if scale else None


def _has_data(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("models"), dict) and bool(data["models"])


def _valid(cols: dict[str, Any], n_modules: int) -> bool:
    """The columns a reader needs, of equal length, with module indices inside the model's table
    (a damaged or crafted trace is left out rather than failing the report)."""
    keys = ("module", "sampled", "zero", "nonfinite", "overflow", "log2_lo", "counts", "abs_max")
    if not all(isinstance(cols.get(k), list) for k in keys):
        return False
    n = len(cols["module"])
    if any(len(cols[k]) != n for k in keys):
        return False
    ints = ("module", "sampled", "zero", "nonfinite", "overflow")
    if not all(_is_int(v) and v >= 0 for k in ints for v in cols[k]):
        return False
    if not all(m < n_modules for m in cols["module"]) or not all(_is_int(v) for v in cols["log2_lo"]):
        return False
    counts_ok = all(isinstance(c, list) and all(_is_int(v) and v >= 0 for v in c) for c in cols["counts"])
    maxima_ok = all(v is None or (_is_num(v) and v >= 0) for v in cols["abs_max"])
    return counts_ok and maxima_ok


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _add_step(
    trace: Trace,
    out: dict[tuple[int, int, str], Entry],
    model: int,
    direction: str,
    cols: dict[str, Any],
    unscale_log2: int | None = None,
) -> None:
    """Add one step's columns; with ``unscale_log2``, gradients are divided back by 2**unscale_log2."""
    shift = unscale_log2 or 0
    for i, module in enumerate(cols["module"]):
        key = (model, module, direction)
        e = out.get(key)
        if e is None:
            name = module_label(trace, model, module) or f"module {module}"
            e = out[key] = Entry(model, module, direction, name)
        e.steps += 1
        e.dtype = str(_at(cols, "dtype", i, ""))
        e.numel = int(_at(cols, "numel", i, 0) or 0)
        e.sampled += cols["sampled"][i]
        e.zero += cols["zero"][i]
        e.nonfinite += cols["nonfinite"][i]
        value = cols["abs_max"][i]
        e.nonfinite_any = e.nonfinite_any or value is None or bool(_at(cols, "nonfinite_any", i, False))
        e.abs_max = max(e.abs_max, float(value or 0.0) / 2.0**shift)
        above = 0  # sampled values at or above 2**16 once unscaled: beyond fp16's max 65504
        for k, c in enumerate(cols["counts"][i]):
            if c:
                exp = cols["log2_lo"][i] + k - shift
                e.counts[exp] = e.counts.get(exp, 0) + c
                above += c if exp >= 16 else 0
        e.overflow += above if unscale_log2 is not None else cols["overflow"][i]
        e.unscaled = e.unscaled or unscale_log2 is not None


def _at(cols: dict[str, Any], key: str, i: int, default: Any) -> Any:
    col = cols.get(key)
    return col[i] if isinstance(col, list) and i < len(col) else default


def evidence(trace: Trace) -> Evidence | None:
    found = entries(trace)
    if not found:
        return None
    cap = trace.device.get("capability")
    capability = list(cap) if isinstance(cap, list) and len(cap) == 2 else None
    bf16: bool | None = None
    if capability is not None:
        bf16 = tuple(capability) >= (8, 0)
    elif isinstance(trace.device.get("bf16_supported"), bool):
        bf16 = trace.device["bf16_supported"]
    return Evidence(found, bf16, capability)


def precision(trace: Trace) -> dict[str, Any] | None:
    """summary.json's ``precision``: the verdict with its findings, or None when not measured."""
    ev = evidence(trace)
    if ev is None:
        return None
    findings = [f for rule in RULES for f in rule(ev)]
    record = trace.collected.get(NAME) or {}
    return {
        **verdict(ev, findings),
        "bf16_available": ev.bf16,
        "device_capability": ev.capability,
        "findings": findings,
        "steps": [s.step for s in measured_steps(trace)],
        "layers_measured": len({(e.model, e.module) for e in ev.entries}),
        "sample_size": record.get("sample_size"),
        "scaled_gradients": any(e.scaled for e in ev.entries),
        "assumed_scale_log2": ASSUMED_SCALE_LOG2,
    }


# ----------------------------------------------------------------------------------------- summary


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``precision`` and, per layer, the fp16 overflow and underflow fractions (null: not measured)."""
    found = entries(trace)
    by_module = {(e.model, e.module, e.direction): e for e in found}
    rows = summary.get("layers", [])
    index = [(info.index, i) for info in trace.models for i in range(len(info.names))]
    for row, (model, module) in zip(rows, index, strict=False):
        for direction, (over, under) in COLUMNS.items():
            e = by_module.get((model, module, direction))
            fr = e.fractions() if e else None
            row[over] = _round(fr["overflow"]) if fr else None
            row[under] = _round(fr["underflow"]) if fr else None
    summary["precision"] = precision(trace)


def _round(x: float) -> float:
    return float(f"{x:.4g}")


# ----------------------------------------------------------------------------------------- report


def riskiest(found: list[Entry], limit: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """Table rows for the layers most at risk: beyond fp16 first, then by the share fp16 loses."""

    def risk(e: Entry) -> tuple[float, ...]:
        fr = e.fractions()
        return (e.beyond_fp16, fr["overflow"] + fr["nonfinite"], fr["flush"], fr["underflow"], e.abs_max)

    rows = []
    unique = [e for e in found if e.same_as is None]
    for e in sorted(unique, key=risk, reverse=True)[:limit]:
        fr = e.fractions()
        rows.append(
            {
                "name": e.name,
                "what": "output" if e.direction == "forward" else "gradient",
                "dtype": e.dtype,
                "abs_max": None if e.nonfinite_any else e.abs_max,
                "nonfinite": e.nonfinite_any,
                **fr,
                "sampled": e.sampled,
                "steps": e.steps,
            }
        )
    return rows


def chart_data(trace: Trace, found: list[Entry]) -> dict[str, Any] | None:
    """Plot-ready histograms: ``{layers, forward, backward, exponents, shown_of}``; each direction a
    list (one per layer) of ``{exponent: fraction}`` (None where not measured). Too many layers:
    those at the shallowest depths that fit ``MAX_CHART_LAYERS``."""
    mods = sorted({(e.model, e.module) for e in found})
    if not mods:
        return None
    shown = _chart_modules(trace, mods)
    by_key = {(e.model, e.module, e.direction): e for e in found}
    exps = sorted({x for e in found for x in e.counts})
    data: dict[str, Any] = {"layers": [], "forward": [], "backward": [], "shown_of": len(mods)}
    for m, i in shown:
        data["layers"].append(module_label(trace, m, i) or f"module {i}")
        for d in DIRECTIONS:
            e = by_key.get((m, i, d))
            data[d].append({x: c / e.sampled for x, c in e.counts.items()} if e and e.sampled else None)
    data["exponents"] = (exps[0], exps[-1]) if exps else (FP16_TINY_LOG2, 0)
    return data


def _chart_modules(trace: Trace, mods: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if len(mods) <= MAX_CHART_LAYERS:
        return mods
    level = {info.index: depths(info) for info in trace.models}
    depth_of = {(m, i): level[m][i] if m in level else 0 for m, i in mods}
    limit = 0
    for d in sorted(set(depth_of.values())):
        if sum(1 for v in depth_of.values() if v <= d) > MAX_CHART_LAYERS:
            break
        limit = d
    return [k for k in mods if depth_of[k] <= limit][:MAX_CHART_LAYERS]
