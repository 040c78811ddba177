"""A trace's steps: which one peaked, its categories at the peak, the timeline as plot-ready series.

Pure data from ``memdoctor.trace``: the memory timeline of a step, its phases and the per-step rows of
``summary.json``.
"""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.layers import ACCOUNTED, ENGINE_CATEGORIES, module_label
from memdoctor.analysis.numbers import median, opt_int
from memdoctor.trace import CATEGORIES, PHASES, StepRecord, Trace


def peak_step(trace: Trace) -> StepRecord | None:
    """The detailed profiled step with the highest peak (timing steps carry no ledger); without
    profiled steps, any step (incomplete too)."""

    def find() -> StepRecord | None:
        pool = trace.detailed_steps() or trace.profiled_steps() or trace.steps
        return max(pool, key=step_peak_bytes, default=None)

    return trace.cached("peak_step", find)  # asked for by every section of a summary and report


def step_peak_bytes(step: StepRecord) -> int:
    """The step's recorded peak; for a step cut short without one, the highest timeline sample."""
    peak = step.memory.get("peak_bytes")
    if isinstance(peak, (int, float)):
        return int(peak)
    totals = [t for t in _sample_totals(step) if t is not None]
    return max(totals, default=0)


def _sample_totals(step: StepRecord) -> list[int | None]:
    """Per timeline sample: the allocator's figure when measured, else the sum of accounted categories."""
    tl = step.timeline
    for name in ("max_allocated", "allocated"):
        if (col := tl.get(name)) is not None:
            return [None if v is None else int(v) for v in col]
    return [sum(int(v or 0) for v in vals) for vals in zip(*category_columns(step).values(), strict=False)]


def category_columns(step: StepRecord) -> dict[str, list[Any]]:
    """The accounted categories per timeline sample, and the engines' where the run had them."""
    tl = step.timeline
    n = len(tl.get("t_ms") or [])
    cols = {c: list(tl.get(c) or [None] * n) for c in ACCOUNTED}
    cols.update({c: list(col) for c in ENGINE_CATEGORIES if (col := tl.get(c)) is not None})
    return cols


def categories_at_peak(step: StepRecord) -> dict[str, int | None]:
    """Bytes per category at the step's peak; from the timeline when the record lacks them. The
    engines' categories are there only for a run that had them (a DDP or FSDP2 rank)."""
    cats = step.memory.get("categories_at_peak")
    if isinstance(cats, dict):
        out = {c: opt_int(cats.get(c)) for c in CATEGORIES}
        out.update({c: opt_int(cats[c]) for c in ENGINE_CATEGORIES if c in cats})
        return out
    totals = _sample_totals(step)
    if not totals:
        return dict.fromkeys(CATEGORIES)
    i = max(range(len(totals)), key=lambda k: totals[k] or 0)
    found: dict[str, int | None] = {c: opt_int(col[i]) for c, col in category_columns(step).items()}
    found["other"] = None
    return found


def median_phases(steps: list[StepRecord]) -> dict[str, float]:
    """Median milliseconds per phase over ``steps``; the standard phases first, then any others."""
    names = list(PHASES) + sorted({k for s in steps for k in s.phases_ms} - set(PHASES))
    out = {p: median([s.phases_ms.get(p) for s in steps]) for p in names}
    return {p: v for p, v in out.items() if v is not None}


def step_rows(trace: Trace) -> list[dict[str, Any]]:
    """One row per step record, in order: timing, phases, and where its peak happened."""
    labels: dict[tuple[Any, Any], str | None] = {}  # a few modules peak in every step: named once

    def label(model: Any, module: Any) -> str | None:
        key = (model, module)
        if key not in labels:
            labels[key] = module_label(trace, model, module)
        return labels[key]

    return [
        {
            "step": s.step,
            "warmup": s.warmup,
            "complete": s.complete,
            "duration_ms": s.duration_ms,
            "phases_ms": dict(s.phases_ms),
            "micro_batches": s.micro_batches,
            "peak_bytes": step_peak_bytes(s),
            "peak_phase": s.memory.get("peak_phase"),
            "peak_module": label(s.memory.get("peak_model"), s.memory.get("peak_module")),
        }
        for s in trace.steps
    ]


def timeline_series(step: StepRecord) -> dict[str, Any]:
    """The step's timeline as plot-ready arrays: time, one series per category, allocator lines, phases."""
    tl = step.timeline
    t = [float(x) for x in tl.get("t_ms") or []]
    phases = list(tl.get("phase") or [])
    k = _setup_samples(t, phases)
    return {
        "t_ms": t[k:],
        "skipped_ms": t[k] - t[0] if k else 0.0,
        "categories": {c: [int(v or 0) for v in col][k:] for c, col in category_columns(step).items()},
        "allocator": {c: _series(tl.get(c))[k:] for c in ("allocated", "reserved") if tl.get(c) is not None},
        "phases": phase_spans(t[k:], phases[k:]),
        "peak_t_ms": step.memory.get("peak_t_ms"),
        "peak_bytes": step_peak_bytes(step),
        "stride": step.timeline_stride,
    }


def _setup_samples(t: list[float], phases: list[Any]) -> int:
    """1 when the step opens with a stretch of "other" longer than the rest of it (the script's set-up
    before the first step's forward), which would squeeze the step into the plot's last sliver; else 0."""
    if len(t) > 2 and len(phases) > 1 and phases[1] == "other" and (t[1] - t[0]) > (t[-1] - t[1]):
        return 1
    return 0


def _series(col: list[Any] | None) -> list[int | None]:
    return [None if v is None else int(v) for v in col or []]


def phase_spans(t_ms: list[float], phases: list[Any]) -> list[dict[str, Any]]:
    """Runs of one phase as ``{phase, start_ms, end_ms}``. A sample's phase is that of the interval
    that ends at it (see ``memdoctor.capture.stepbuild.interval_phases``), so sample i colours the
    time from sample i-1 to sample i."""
    spans: list[dict[str, Any]] = []
    for i in range(1, min(len(t_ms), len(phases))):
        start, end, phase = t_ms[i - 1], t_ms[i], phases[i]
        if spans and spans[-1]["phase"] == phase:
            spans[-1]["end_ms"] = end
        else:
            spans.append({"phase": phase, "start_ms": start, "end_ms": end})
    return spans


def steps_found(trace: Trace) -> dict[str, Any] | None:
    """How the profiler told the steps apart (the ``steps`` collector record; traces before it found
    steps at optimizer steps only): ``by`` ("optimizer" or "backward") and ``how``, one line in words.
    None before any step was found."""
    by = (trace.collected.get("steps") or {}).get("found_by")
    optimizers = max((m.optimizers for m in trace.models), key=len, default=[])
    if by is None:
        if not optimizers:
            return None
        by = "optimizer"
    if by == "backward":
        how = (
            "from backward passes: no torch.optim optimizer stepped, so a step ends at the first training "
            "forward after the parameters were updated by hand (or their gradients reset)"
        )
        return {"by": by, "how": how, "optimizers": []}
    names = [str(o.get("class")) for o in optimizers]
    if len(names) > 1:
        each = ", ".join(names)
        how = f"at optimizer steps: a step ends after the last of its {len(names)} optimizers ({each})"
    else:
        how = f"at each optimizer step ({names[0] if names else 'optimizer'})"
    return {"by": by, "how": how, "optimizers": names}
