"""Gradient norms: the global norm per step, the chart's per-layer norms, and the findings (NaN/Inf,
exploding and vanishing gradients, steps a GradScaler skipped) of the ``gradnorms`` and ``gradscaler``
collectors' columns."""

from __future__ import annotations

import math
import statistics
from typing import Any

from memdoctor.analysis.layers import (
    TOP_LAYERS,
    children,
    model_prefix,
    model_rows,
    module_columns,
    module_label,
    repeated_blocks,
    subtree_sums,
    top_modules,
)
from memdoctor.analysis.numbers import median_of_others, opt_float
from memdoctor.analysis.steps import peak_step
from memdoctor.trace import ModelInfo, StepRecord, Trace

VANISHING_RATIO = 1e3  # a block this many times below the median of its neighbours is flagged
VANISHING_NEIGHBOURS = 2  # blocks compared on each side
EXPLODING_RATIO = 1e3  # a step's global norm this many times the other steps' median is flagged
EXPLODING_NORM = 1e4  # and so is a global norm above this
GRAD_CHART_STEPS = 8


def grad_norm_steps(trace: Trace) -> list[StepRecord]:
    """Complete steps that measured gradient norms (warm-up steps included), in order; not the steps a
    GradScaler skipped (their Inf/NaN gradients never reached the weights: see ``scaler_skip_flags``)."""
    return list(
        trace.cached(
            "grad_norm_steps",
            lambda: [s for s in trace.steps if s.complete and _has_grad_norms(s) and not scaler_skipped(s)],
        )
    )


def scaler_skipped(step: StepRecord) -> bool:
    """Whether a ``torch.amp.GradScaler`` skipped this step's optimizer step."""
    return bool(step.grad_scaler and step.grad_scaler.get("skipped"))


def _has_grad_norms(step: StepRecord) -> bool:
    for cols in step.modules.values():  # noqa: SIM110 (a loop: any(<generator>) costs 3x, for every step)
        if "grad_norm" in cols:
            return True
    return False


def step_grad_norm(step: StepRecord) -> dict[str, Any] | None:
    """``{global, nonfinite_modules, first_nonfinite}`` of a step, from its per-module columns (the
    trace's step field, recomputed); ``None`` where the step did not measure gradient norms."""
    if not _has_grad_norms(step):
        return None
    if step.grad_norm is not None:
        return step.grad_norm
    squares, ranked = 0.0, []
    for m in sorted(step.modules):
        cols = step.modules[m]
        squares += sum(float(v) * float(v) for v in cols.get("grad_norm") or [] if v is not None)
        ranked += [(r, [m, i]) for i, r in enumerate(cols.get("grad_nonfinite") or []) if r]
    bad = [loc for _, loc in sorted(ranked)]
    total = None if bad or not math.isfinite(squares) else float(f"{math.sqrt(squares):.6g}")
    return {"global": total, "nonfinite_modules": bad, "first_nonfinite": bad[0] if bad else None}


def grad_norm_series(trace: Trace, steps: list[StepRecord] | None = None) -> list[dict[str, Any]]:
    """The global gradient norm per step that measured it (``null``: NaN or Inf); ``steps``: the
    trace's ``grad_norm_steps``, when the caller has them (every finding reads them: found once)."""
    steps = grad_norm_steps(trace) if steps is None else steps
    return [{"step": s.step, "global": (step_grad_norm(s) or {}).get("global")} for s in steps]


def inclusive_grad_norms(info: ModelInfo, cols: dict[str, list[Any]]) -> list[float | None]:
    """Each module's norm over its whole subtree; ``None`` with no gradient, or a NaN/Inf inside."""
    squares = [None if v is None else float(v) * float(v) for v in cols["grad_norm"]]
    bad = [bool(r) for r in cols["grad_nonfinite"]]
    for i in range(len(squares) - 1, 0, -1):
        p, q = info.parents[i], squares[i]
        if p >= 0:
            bad[p] = bad[p] or bad[i]
            if q is not None:
                squares[p] = (squares[p] or 0.0) + q
    return [
        None if b or q is None or not math.isfinite(q) else math.sqrt(q)
        for q, b in zip(squares, bad, strict=True)
    ]


def grad_flags(trace: Trace) -> list[dict[str, Any]]:
    """Every gradient-norm finding, ``{kind, module, step, evidence}``: each kind and module once, at the
    first step it showed in, with how many of the measured steps showed it."""
    steps = grad_norm_steps(trace)
    return scaler_skip_flags(trace) + [
        f for rule in GRAD_RULES for f in _once(rule(trace, steps), len(steps))
    ]


def nonfinite_flags(trace: Trace, steps: list[StepRecord] | None = None) -> list[dict[str, Any]]:
    """NaN or Inf gradients. The optimizer step writes them into the weights, and the loss turns NaN from
    then on. The module named is the first whose gradient was non-finite in backward order, where the
    NaN or Inf appeared: backward carries it from there to the modules before it, which show it too."""
    out = []
    for s in grad_norm_steps(trace) if steps is None else steps:
        g = step_grad_norm(s)
        if g and g["first_nonfinite"]:
            n, where = len(g["nonfinite_modules"]), module_label(trace, *g["first_nonfinite"])
            text = f"NaN/Inf gradient in {n} module{'' if n == 1 else 's'}; it appeared first in {where}"
            out.append(_grad_flag("nonfinite", where, s.step, text))
    return out


def exploding_flags(trace: Trace, steps: list[StepRecord] | None = None) -> list[dict[str, Any]]:
    """Exploding gradients: a step whose global gradient norm is above ``EXPLODING_NORM`` (1e4), or
    ``EXPLODING_RATIO`` (1000) times the median of the other steps' or more. One such step can throw the
    weights far off; gradient clipping (``clip_grad_norm_``) or a lower learning rate are the usual cures.
    The module named holds the largest gradient norm of that step."""
    steps = grad_norm_steps(trace) if steps is None else steps
    norms = {r["step"]: r["global"] for r in grad_norm_series(trace, steps)}
    ordered = sorted(v for v in norms.values() if v is not None)
    out = []
    for s in steps:
        norm = norms[s.step]
        others = median_of_others(ordered, norm) if norm is not None else None
        reason = _exploding_reason(norm, others)
        if reason:
            name, value = _largest_grad_module(trace, s)
            out.append(_grad_flag("exploding", name, s.step, f"{reason}; largest in {name} ({value:.3g})"))
    return out


def _exploding_reason(norm: float | None, median: float | None) -> str | None:
    if norm is None:
        return None
    if norm > EXPLODING_NORM:
        return f"global gradient norm {norm:.3g}, above {EXPLODING_NORM:.0e}"
    if median and norm >= EXPLODING_RATIO * median:
        times = f"{norm / median:.3g}x the median of the other steps ({median:.3g})"
        return f"global gradient norm {norm:.3g}, {times}"
    return None


def _largest_grad_module(trace: Trace, step: StepRecord) -> tuple[str | None, float]:
    best: tuple[float, int, int] = (-1.0, 0, 0)
    for m, cols in step.modules.items():
        for i, v in enumerate(cols.get("grad_norm") or []):
            if v is not None and v > best[0]:
                best = (float(v), m, i)
    return module_label(trace, best[1], best[2]), best[0]


def vanishing_flags(trace: Trace, steps: list[StepRecord] | None = None) -> list[dict[str, Any]]:
    """Vanishing gradients: a block of a repeated stack (``encoder.layer.4`` of ``layer.0..11``) whose
    gradient norm, over all its submodules, is ``VANISHING_RATIO`` (1000) times or more below the median
    of its neighbours (up to two blocks on each side). Its weights barely learn; look for what cuts the
    gradient there (a saturated activation, a detach, a residual path that skips it, a bad init)."""
    out: list[dict[str, Any]] = []
    # each block with its neighbours, found once for all steps
    hoods = [(info, _neighbourhoods(repeated_blocks(info))) for info in trace.models]
    hoods = [(info, h) for info, h in hoods if h]
    if not hoods:
        return out
    for s in grad_norm_steps(trace) if steps is None else steps:
        for info, h in hoods:
            out += _vanishing_in(trace, info, h, s)
    return out


def _neighbourhoods(stacks: list[list[int]]) -> list[tuple[int, list[int]]]:
    """``(block, its neighbours)`` of every block of ``stacks``: up to ``VANISHING_NEIGHBOURS`` each side."""
    n = VANISHING_NEIGHBOURS
    return [
        (i, blocks[max(0, k - n) : k] + blocks[k + 1 : k + 1 + n])
        for blocks in stacks
        for k, i in enumerate(blocks)
    ]


def _vanishing_in(
    trace: Trace, info: ModelInfo, hoods: list[tuple[int, list[int]]], step: StepRecord
) -> list[dict[str, Any]]:
    norms = inclusive_grad_norms(info, _grad_columns(info, step))
    known = [v for v in (norms[i] for i, _ in hoods) if v is not None]
    # A flagged block's norm is at least the smallest, and its neighbours' median at most the largest:
    # when the smallest is within the ratio of the largest, no block is flagged (nearly every step).
    if not known or min(known) * VANISHING_RATIO > max(known):
        return []
    out = []
    for i, near in hoods:
        value = norms[i]
        if value is None:
            continue
        values = [v for v in (norms[j] for j in near) if v is not None]
        med = statistics.median(values) if values else None
        if med is None or value * VANISHING_RATIO > med:
            continue
        name = module_label(trace, info.index, i)
        ratio = f"{med / value:.3g}x" if value > 0 else "infinitely"
        text = f"gradient norm {value:.3g}, {ratio} below the median of its neighbours ({med:.3g})"
        out.append(_grad_flag("vanishing", name, step.step, text))
    return out


def _grad_columns(info: ModelInfo, step: StepRecord) -> dict[str, list[Any]]:
    """The step's ``grad_norm`` and ``grad_nonfinite`` columns for this model, padded with ``None``
    where missing or short (``module_columns`` of only the two columns a finding reads, once a step)."""
    n = len(info.names)
    cols = step.modules.get(info.index) or {}
    out = {}
    for key in ("grad_norm", "grad_nonfinite"):
        col = cols.get(key)
        out[key] = col if col is not None and len(col) == n else (list(col or []) + [None] * n)[:n]
    return out


def scaler_skip_flags(trace: Trace) -> list[dict[str, Any]]:
    """Steps a GradScaler skipped: their scaled gradients held Inf/NaN. A few while the scaler lowers
    its scale are how fp16 loss scaling works; every step skipped means the model itself produces
    Inf/NaN (or the scale never gets low enough), and it does not train."""
    scaled = [s for s in trace.steps if s.complete and s.grad_scaler]
    skipped = [s for s in scaled if scaler_skipped(s)]
    if not skipped:
        return []
    scales = [s.grad_scaler.get("scale") for s in scaled if s.grad_scaler]
    shown = [f"{v:g}" for v in scales if v is not None]
    trend = f"; loss scale {shown[0]} at the first step, {shown[-1]} at the last" if shown else ""
    kind = "nonfinite" if len(skipped) == len(scaled) else "scaler_skipped"
    what = "expected while it finds its scale"
    if kind == "nonfinite":
        what = "every step: the model does not train"
    text = (
        f"torch.amp.GradScaler skipped {len(skipped)} of {len(scaled)} steps (steps "
        f"{', '.join(str(s.step) for s in skipped[:8])}{' ...' if len(skipped) > 8 else ''}): Inf/NaN in the "
        f"scaled gradients, {what}{trend}"
    )
    return [{**_grad_flag(kind, None, skipped[0].step, text), "count": len(skipped)}]


GRAD_RULES = (nonfinite_flags, exploding_flags, vanishing_flags)


def _grad_flag(kind: str, module: str | None, step: int, evidence: str) -> dict[str, Any]:
    return {"kind": kind, "module": module, "step": step, "evidence": evidence}


def _once(flags: list[dict[str, Any]], measured: int) -> list[dict[str, Any]]:
    """The first flag of each module, its evidence saying in how many of the measured steps it showed."""
    first: dict[Any, dict[str, Any]] = {}
    count: dict[Any, int] = {}
    for f in flags:
        first.setdefault(f["module"], f)
        count[f["module"]] = count.get(f["module"], 0) + 1
    return [
        {**f, "evidence": f"{f['evidence']} (in {count[key]} of {measured} steps measured)"}
        for key, f in first.items()
    ]


def grad_norm_chart(trace: Trace) -> dict[str, Any] | None:
    """Plot-ready gradient norms: ``{layers: [name], steps: [{step, warmup, norms}]}``, one norm per layer.

    The layers are every module that owns parameters when there are at most ``TOP_LAYERS`` of them, else
    the top-level layers of ``top_layers`` (a layer's norm covers its submodules; ``(own)``: only its own
    parameters). ``None`` when no step measured gradient norms."""
    steps = grad_norm_steps(trace)
    if not steps:
        return None
    if len(steps) > GRAD_CHART_STEPS:
        picks = {round(k * (len(steps) - 1) / (GRAD_CHART_STEPS - 1)) for k in range(GRAD_CHART_STEPS)}
        steps = [steps[k] for k in sorted(picks)]
    layers = _grad_layers(trace)
    return {
        "layers": [name for _, _, _, name in layers],
        "steps": [{"step": s.step, "warmup": s.warmup, "norms": _layer_norms(s, layers)} for s in steps],
    }


def _grad_layers(trace: Trace) -> list[tuple[ModelInfo, int, bool, str]]:
    """``(model, module, own_only, name)`` of the layers the gradient-norm chart shows."""
    owners = [(info, i) for info in trace.models for i, b in enumerate(info.param_bytes) if b > 0]
    if len(owners) <= TOP_LAYERS:
        return [(info, i, True, model_prefix(trace, info) + info.display_name(i)) for info, i in owners]
    out = []
    step = peak_step(trace)
    for info in trace.models:
        params = subtree_sums(info, info.param_bytes)
        for i, own in top_modules(info, model_rows(trace, info, step)):
            if (info.param_bytes[i] if own else params[i]) > 0:
                suffix = " (own)" if own and children(info)[i] else ""
                out.append((info, i, own, model_prefix(trace, info) + info.display_name(i) + suffix))
    return out


def _layer_norms(step: StepRecord, layers: list[tuple[ModelInfo, int, bool, str]]) -> list[float | None]:
    out: list[float | None] = []
    cache: dict[int, tuple[dict[str, list[Any]], list[float | None]]] = {}
    for info, i, own, _ in layers:
        if info.index not in cache:
            cols = module_columns(info, step)
            cache[info.index] = (cols, inclusive_grad_norms(info, cols))
        cols, incl = cache[info.index]
        out.append(opt_float(cols["grad_norm"][i]) if own else incl[i])
    return out
