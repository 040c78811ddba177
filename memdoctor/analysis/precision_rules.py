"""Mixed precision: is fp16 + GradScaler safe for this model, does it need another loss scale, or is
bf16 the only safe choice? The rules that answer it from the histograms' entries (``histograms.py``).

Small rule functions in ``RULES`` return findings with their evidence; ``verdict`` combines them. The
figures are those of the run as recorded: a run already under fp16 autocast with a ``GradScaler``
shows gradients multiplied by its loss scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memdoctor.units import first_names

FP16_MAX = 65504.0
FP16_SUBNORMAL_LOG2 = -14  # fp16's smallest normal is 2**-14
FP16_TINY_LOG2 = -24  # fp16's smallest subnormal is 2**-24: below it a value flushes to zero
ASSUMED_SCALE_LOG2 = 16  # torch.amp.GradScaler's default init_scale, 2**16
NEAR_ZERO_LOG2 = -10  # "mass near zero": |x| < 2**-10 (about 1e-3), zeros included
FLUSH_TOLERANCE = 0.01  # a layer may lose up to 1% of its gradient values to fp16's flush
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
    Gradients at 1e-9 are 2**-30: they survive a 2**16 scale, but not a 2**4."""
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
