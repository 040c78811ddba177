"""Mixed precision: is fp16 + GradScaler safe for this model, does it need another loss scale, or is
bf16 the only safe choice? Read from the activation and gradient histograms (``collectors.histograms``).

Each module's output and output gradient are aggregated over every step that measured them (counts
summed, the absolute max the largest seen). Small rule functions in ``RULES`` return findings with
their evidence; ``verdict`` combines them. The figures are those of the run as recorded: a run
already under fp16 autocast with a ``GradScaler`` shows gradients multiplied by its loss scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memdoctor.analysis import summary as an
from memdoctor.report import plots_precision
from memdoctor.trace import Trace
from memdoctor.units import first_names

NAME = "histograms"
FP16_MAX = 65504.0
FP16_SUBNORMAL_LOG2 = -14  # fp16's smallest normal is 2**-14
FP16_TINY_LOG2 = -24  # fp16's smallest subnormal is 2**-24: below it a value flushes to zero
ASSUMED_SCALE_LOG2 = 16  # torch.amp.GradScaler's default init_scale, 2**16
NEAR_ZERO_LOG2 = -10  # "mass near zero": |x| < 2**-10 (about 1e-3), zeros included
FLUSH_TOLERANCE = 0.01  # a layer may lose up to 1% of its gradient values to fp16's flush
TABLE_ROWS = 12
MAX_CHART_LAYERS = 40
DIRECTIONS = ("forward", "backward")
COLUMNS = {
    "forward": ("fp16_overflow_fraction", "fp16_underflow_fraction"),
    "backward": ("grad_fp16_overflow_fraction", "grad_fp16_underflow_fraction"),
}
VERDICTS = {
    "fp16_safe": "fp16 + GradScaler is safe",
    "fp16_rescale": "fp16 needs a different loss scale",
    "bf16_only": "only bf16 is safe",
}


@dataclass
class Entry:
    """One module's output (``forward``) or output gradient (``backward``), over the measured steps."""

    model: int
    module: int
    direction: str
    name: str
    dtype: str = ""
    numel: int = 0
    sampled: int = 0
    zero: int = 0
    nonfinite: int = 0
    overflow: int = 0
    abs_max: float = 0.0
    nonfinite_any: bool = False
    steps: int = 0
    counts: dict[int, int] = field(default_factory=dict)  # floor(log2|x|) -> sampled values
    # A module whose output is a submodule's output (a Sequential, a block returning its last
    # layer's tensor) has identical figures: findings name the innermost one and skip this.
    same_as: str | None = None
    # Divided back by the GradScaler's recorded loss scale (every gradient under a scaler is scaled,
    # whatever its dtype), so that it reads as an unscaled gradient.
    unscaled: bool = False

    def signature(self) -> tuple[Any, ...]:
        return (self.sampled, self.abs_max, self.zero, self.overflow, tuple(sorted(self.counts.items())))

    def below(self, log2: int) -> int:
        """Sampled non-zero finite values with |x| < 2**log2."""
        return sum(c for e, c in self.counts.items() if e < log2)

    def fraction(self, count: int) -> float:
        return count / self.sampled if self.sampled else 0.0

    def fractions(self) -> dict[str, float]:
        """fp16 ``overflow`` (|x| > 65504 or inf), ``underflow`` (non-zero below 2**-14, subnormal),
        ``flush`` (non-zero below 2**-24, flushed to zero), ``near_zero`` (|x| < 2**-10 or zero)."""
        return {
            "overflow": self.fraction(self.overflow),
            "underflow": self.fraction(self.below(FP16_SUBNORMAL_LOG2)),
            "flush": self.fraction(self.below(FP16_TINY_LOG2)),
            "near_zero": self.fraction(self.zero + self.below(NEAR_ZERO_LOG2)),
            "nonfinite": self.fraction(self.nonfinite),
        }

    @property
    def beyond_fp16(self) -> bool:
        """Exact (the max is over the whole tensor): some value is above fp16's max, or Inf/NaN."""
        return self.nonfinite_any or self.abs_max > FP16_MAX

    @property
    def scaled(self) -> bool:
        """A gradient still multiplied by a loss scale: an fp16 gradient, when the trace did not record
        the GradScaler's scale (then an fp32 gradient under a scaler is read as unscaled: a limit of
        traces from before memdoctor 0.x recorded ``grad_scaler``)."""
        return self.direction == "backward" and self.dtype == "float16" and not self.unscaled


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
        s
        for s in trace.steps
        if s.complete and _has_data(s.collectors.get(NAME)) and not an.scaler_skipped(s)
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
            name = an.module_label(trace, model, module) or f"module {module}"
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


# ----------------------------------------------------------------------------------------- rules


@dataclass
class Evidence:
    """What the rules read: the measured entries and the device's bf16 support."""

    entries: list[Entry]
    bf16: bool | None  # the profiled device has bf16 (compute capability >= 8.0); None: unknown
    capability: list[int] | None

    def forward(self) -> list[Entry]:
        """Module outputs, each tensor once (the innermost module that returned it)."""
        return self._judged("forward")

    def backward(self) -> list[Entry]:
        """Output gradients, each tensor once."""
        return self._judged("backward")

    def _judged(self, direction: str) -> list[Entry]:
        # A scalar output is a loss: autocast computes it in fp32, and its gradient is the loss
        # scale itself, so it says nothing about fp16's range (numel 0: a trace without numel).
        return [e for e in self.entries if e.direction == direction and e.same_as is None and e.numel != 1]


Finding = dict[str, Any]


def activation_overflow(ev: Evidence) -> list[Finding]:
    """Activations beyond fp16's range: a layer's output holds a value above 65504 (its exact
    maximum over the whole tensor), or already Inf/NaN. Under fp16 autocast that output becomes Inf
    and no loss scale can help (the scale only multiplies gradients): only bf16, whose range is
    fp32's, is safe for these layers, or keeping them in fp32."""
    bad = [e for e in ev.forward() if e.beyond_fp16]
    if not bad:
        return []
    shown = first_names([_overflow_text(e) for e in bad], 5, "; ")
    text = f"{len(bad)} layer output(s) exceed fp16's max 65504, first in model order: {shown}"
    return [_finding("activation_overflow", "risk", bad, text)]


def gradient_underflow(ev: Evidence) -> list[Finding]:
    """Gradients that fp16 flushes to zero even after the loss scale: non-zero gradient values below
    2**-24 / scale (2**-40 at GradScaler's default 2**16) in more than 1% of a layer's sampled values.
    The story's layer-4 gradients at 1e-9 are 2**-30: they survive a 2**16 scale, but not a 2**4."""
    lost = []
    for e in ev.backward():
        scale = 0 if e.scaled else ASSUMED_SCALE_LOG2
        share = e.fraction(e.below(FP16_TINY_LOG2 - scale))
        if share > FLUSH_TOLERANCE:
            lost.append((share, e))
    if not lost:
        return []
    lost.sort(key=lambda p: -p[0])
    scaled = any(e.scaled for _, e in lost)
    where = "as recorded (already scaled)" if scaled else f"after a 2^{ASSUMED_SCALE_LOG2} loss scale"
    text = f"{len(lost)} layer(s) lose output-gradient values below fp16's 2^-24 {where}: " + _listing(lost)
    return [_finding("gradient_underflow", "risk", [e for _, e in lost], text)]


def _listing(shares: list[tuple[float, Entry]], limit: int = 5) -> str:
    return first_names([f"{e.name} ({_pct(share)})" for share, e in shares], limit)


def scaled_gradient_overflow(ev: Evidence) -> list[Finding]:
    """Gradients that overflow fp16 once multiplied by the loss scale: the GradScaler then skips the
    step and halves the scale until they fit (a few skipped steps, harmless unless it keeps
    happening); the largest safe scale is 65504 / the largest gradient."""
    grads = [e for e in ev.backward() if e.abs_max > 0 or e.nonfinite_any]
    if not grads:
        return []
    top = max(grads, key=lambda e: (e.nonfinite_any, e.abs_max))
    scale = 0 if top.scaled else ASSUMED_SCALE_LOG2
    if not top.nonfinite_any and top.abs_max * 2.0**scale <= FP16_MAX:
        return []
    if top.nonfinite_any:
        text = f"{top.name}: its output gradient already holds Inf or NaN"
    elif top.scaled:
        text = f"{top.name}: gradient |g| max {_num(top.abs_max)} (already scaled) exceeds 65504"
    else:
        scaled = _num(top.abs_max * 2.0**scale)
        text = f"{top.name}: gradient |g| max {_num(top.abs_max)} x 2^{scale} = {scaled} exceeds 65504"
    return [_finding("scaled_gradient_overflow", "note", [top], text)]


def activation_underflow(ev: Evidence) -> list[Finding]:
    """Activations that fp16 loses: more than 1% of a layer's output non-zero below 2**-24 (flushed
    to zero). Training usually survives it (the values are tiny), but it is the 'outputs piled up
    near 0' symptom; bf16 keeps them (its smallest normal is 2**-126)."""
    lost = [(e.fraction(e.below(FP16_TINY_LOG2)), e) for e in ev.forward()]
    lost = sorted((p for p in lost if p[0] > FLUSH_TOLERANCE), key=lambda p: -p[0])
    if not lost:
        return []
    text = f"{len(lost)} layer output(s) hold non-zero values below fp16's 2^-24: " + _listing(lost)
    return [_finding("activation_underflow", "note", [e for _, e in lost], text)]


def no_bf16(ev: Evidence) -> list[Finding]:
    """bf16 needs compute capability 8.0 (Ampere) or newer: Turing cards (RTX 20xx, T4: 7.5) and
    older run bf16 emulated or not at all. On such a card "only bf16 is safe" means: keep the named
    layers in fp32 (exclude them from autocast) or train in fp32."""
    if ev.bf16 is not False:
        return []
    cap = ".".join(str(c) for c in ev.capability or [])
    text = f"this device (compute capability {cap or 'unknown'}) has no native bf16 (needs 8.0 or newer)"
    return [_finding("no_bf16", "note", [], text)]


RULES: list[Callable[[Evidence], list[Finding]]] = [
    activation_overflow,
    gradient_underflow,
    scaled_gradient_overflow,
    activation_underflow,
    no_bf16,
]


def _finding(rule: str, severity: str, layers: list[Entry], evidence: str) -> Finding:
    return {"rule": rule, "severity": severity, "layers": [e.name for e in layers[:20]], "evidence": evidence}


def _overflow_text(e: Entry) -> str:
    if e.nonfinite_any:
        return f"{e.name} (Inf/NaN, {_pct(e.fraction(e.nonfinite))} of sampled values non-finite)"
    return f"{e.name} (|x| max {_num(e.abs_max)}, {_pct(e.fraction(e.overflow))} of sampled values beyond)"


def _pct(x: float) -> str:
    return f"{100 * x:.2g}%" if 0 < x < 0.01 else f"{100 * x:.0f}%"


def _num(x: float) -> str:
    return f"{x:.3g}"


# ----------------------------------------------------------------------------------------- verdict


def scale_window(ev: Evidence) -> tuple[int, int] | None:
    """The loss scales (as log2) that fit every recorded gradient: no overflow above 65504 (from the
    exact max) and at most 1% of any layer's values flushed below 2**-24. None: no gradient was
    measured unscaled (fp16 gradients are already scaled), or no scale fits."""
    grads = [e for e in ev.backward() if not e.scaled and e.sampled]
    if not grads or any(e.nonfinite_any for e in grads):
        return None
    top = max(e.abs_max for e in grads)
    hi = math.floor(math.log2(FP16_MAX / top)) if top > 0 else 64
    lo = max(_min_scale(e) for e in grads)
    return (lo, hi) if lo <= hi else None


def _min_scale(e: Entry) -> int:
    """The smallest log2 scale after which at most FLUSH_TOLERANCE of the layer's values flush."""
    for k in range(-64, 65):
        if e.fraction(e.below(FP16_TINY_LOG2 - k)) <= FLUSH_TOLERANCE:
            return k
    return 65


def verdict(ev: Evidence, findings: list[Finding]) -> dict[str, Any]:
    """The verdict, and the loss scale to use when fp16 works with another one."""
    rules = {f["rule"] for f in findings}
    window = scale_window(ev)
    grads = [e for e in ev.backward() if not e.scaled]
    if "activation_overflow" in rules:
        key, why = "bf16_only", "activations overflow fp16 in the named layers"
    elif grads and window is None:
        key, why = "bf16_only", "no single loss scale keeps every gradient inside fp16's range"
    elif window is not None and not window[0] <= ASSUMED_SCALE_LOG2 <= window[1]:
        key, why = (
            "fp16_rescale",
            f"GradScaler's default 2^{ASSUMED_SCALE_LOG2} lies outside the scales that fit",
        )
    elif "gradient_underflow" in rules:  # fp16 gradients recorded already scaled
        key, why = "fp16_rescale", "gradients flush to zero at the script's loss scale"
    else:
        key, why = "fp16_safe", "activations stay inside fp16's range and the gradients fit a 2^16 scale"
    suggested = None
    if window is not None:
        suggested = min(window[1], max(window[0], ASSUMED_SCALE_LOG2))
    return {
        "verdict": key,
        "title": VERDICTS[key],
        "reason": why,
        "scale_window_log2": list(window) if window else None,
        "suggested_init_scale_log2": suggested,
    }


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
        data["layers"].append(an.module_label(trace, m, i) or f"module {i}")
        for d in DIRECTIONS:
            e = by_key.get((m, i, d))
            data[d].append({x: c / e.sampled for x, c in e.counts.items()} if e and e.sampled else None)
    data["exponents"] = (exps[0], exps[-1]) if exps else (FP16_TINY_LOG2, 0)
    return data


def _chart_modules(trace: Trace, mods: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if len(mods) <= MAX_CHART_LAYERS:
        return mods
    level = {info.index: an.depths(info) for info in trace.models}
    depth_of = {(m, i): level[m][i] if m in level else 0 for m, i in mods}
    limit = 0
    for d in sorted(set(depth_of.values())):
        if sum(1 for v in depth_of.values() if v <= d) > MAX_CHART_LAYERS:
            break
        limit = d
    return [k for k in mods if depth_of[k] <= limit][:MAX_CHART_LAYERS]


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The report's precision section: verdict, findings, riskiest layers and the histogram chart."""
    result = summary.get("precision")
    if result is None:
        return None
    found = entries(trace)
    chart = chart_data(trace, found)
    return {
        "result": result,
        "rows": riskiest(found),
        "chart": plots_precision.histogram_heatmap(chart) if chart else None,
        "chart_layers": len(chart["layers"]) if chart else 0,
        "chart_of": chart["shown_of"] if chart else 0,
        "near_zero_log2": NEAR_ZERO_LOG2,
    }
