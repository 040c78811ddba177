"""What a trace says, as plain data: the content of ``summary.json`` and the tables the report draws.

Every function here is pure: it reads a ``memdoctor.trace.Trace`` and returns dicts, lists and numbers.
No torch, no drawing. The report layer (``memdoctor.report``) turns these into HTML and plots.

Conventions for per-module figures (as in the trace): parameters, gradients and optimizer state are
*exclusive* (what the module owns directly); activations and forward/backward times are *inclusive*
of submodules. Where a table needs inclusive parameter figures it sums the subtree itself.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from memdoctor.analysis import sections
from memdoctor.trace import CATEGORIES, PHASES, ModelInfo, StepRecord, Trace
from memdoctor.units import format_bytes
from memdoctor.version import __version__

SUMMARY_FORMAT_VERSION = 1
ACCOUNTED = ("parameters", "gradients", "optimizer_state", "activations")
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other": "other (temporaries, workspaces, allocator slack)",
}
# Trace columns that hold a module's exclusive figure for each accounted category.
_OWN_COLUMNS = {"gradients": "grad_bytes", "optimizer_state": "optimizer_state_bytes"}
_NORMAL_STATUSES = ("completed", "script_finished", "no_steps")
_FAULT_EVENT_KINDS = ("oom", "exception", "interrupted", "script_exit")
_ALLOCATOR_COLUMNS = ("allocated", "reserved", "max_allocated")
MODULE_COLUMNS = (
    *("activation_bytes", "activation_self_bytes", "checkpoint_free_bytes", "grad_bytes"),
    *("optimizer_state_bytes", "forward_ms", "backward_ms", "calls", "grad_norm", "grad_nonfinite"),
)
DOMINANT_SHARE = 0.8
TOP_LAYERS = 24
OWN_BAR_SHARE = 0.01


# ----------------------------------------------------------------------------------------- summary


def build_summary(trace: Trace) -> dict[str, Any]:
    """The content of ``summary.json``: the headline figures, the fault (if any) and every module."""
    step = peak_step(trace)
    summary: dict[str, Any] = {
        "format_version": SUMMARY_FORMAT_VERSION,
        "memdoctor_version": __version__,
        "trace_memdoctor_version": trace.header.get("memdoctor_version"),
        "status": (trace.end or {}).get("status", "unknown"),
        "device": device_info(trace),
        "budget_bytes": trace.settings.get("budget_bytes"),
        "not_measured": not_measured(trace),
        "steps_profiled": len(trace.profiled_steps()),
        "step_time_ms": _median([s.duration_ms for s in unperturbed(trace.profiled_steps())]),
        "phases_ms": median_phases(trace.detailed_steps()),
        **peak_figures(trace, step),
        "layers": summary_layers(trace, step),
        "steps": step_rows(trace),
        "events": [event_row(trace, e) for e in trace.events],
        "fault": fault_info(trace),
        "live_at_fault": live_at_fault(trace),
        "peak_ledger": peak_ledger(trace, step),
        "grad_norm": grad_norm_series(trace),
        "grad_flags": grad_flags(trace),
    }
    sections.summarize(trace, summary)
    summary["headline"] = headline(summary)
    return summary


def unperturbed(steps: list[StepRecord]) -> list[StepRecord]:
    """The steps whose time is the script's own: not the one step the flops collector slowed down by
    counting every operation (``collectors.flops.perturbed``), unless no other step is left."""
    clean = [s for s in steps if not (s.collectors.get("flops") or {}).get("perturbed")]
    return clean or steps


def peak_ledger(trace: Trace, step: StepRecord | None) -> dict[str, Any] | None:
    """The allocator-history ledger of the peak step, else of the last step that has one.

    Present only for CUDA runs where the allocator's history could be recorded; every byte allocated
    at that step's peak, attributed to a known tensor or to the code that allocated it."""
    candidates = ([step] if step is not None else []) + list(reversed(trace.steps))
    for s in candidates:
        led = s.memory.get("peak_ledger")
        if isinstance(led, dict) and isinstance(led.get("categories"), dict):
            return {**led, "step": s.step}
    return None


def peak_phase(step: StepRecord) -> str | None:
    """The recorded peak phase; for traces that recorded "other" at a pre-hook sample, the phase that
    sample opens (derived from the timeline, as the capture now records it)."""
    recorded = step.memory.get("peak_phase")
    tl = step.timeline
    times, phases, events = tl.get("t_ms"), tl.get("phase"), tl.get("event")
    if recorded != "other" or not times or not phases or not events:
        return recorded
    at = step.memory.get("peak_t_ms")
    i = next((k for k, t in enumerate(times) if t == at), None)
    if i is None:
        return recorded
    if events[i] == "fwd_pre":
        return "forward"
    return str(phases[i + 1]) if i + 1 < len(phases) else recorded


def device_info(trace: Trace) -> dict[str, Any]:
    dev = trace.device
    return {
        "name": dev.get("name", "unknown"),
        "kind": dev.get("kind", "unknown"),
        "total_memory_bytes": dev.get("total_memory_bytes"),
        "memory_cap_bytes": dev.get("memory_cap_bytes"),
    }


def not_measured(trace: Trace) -> list[str]:
    """The header's list of what was not measured, plus what the data itself shows is missing."""
    notes = [str(n) for n in trace.header.get("not_measured", [])]
    no_allocator = trace.steps and not any(_has_allocator(s) for s in trace.steps)
    if no_allocator and not any("allocator" in n for n in notes):
        notes.append("allocator figures: not recorded in this trace")
    strides = sorted({s.timeline_stride for s in trace.steps if s.timeline_stride > 1})
    if strides:
        notes.append(f"memory timeline: downsampled (1 in {strides[-1]} samples kept at most)")
    if trace.truncated:
        notes.append("trace: its tail was cut off (the run died while writing it); later records are lost")
    return notes


def _has_allocator(step: StepRecord) -> bool:
    return bool(step.memory.get("allocator")) or step.timeline.get("allocated") is not None


def peak_figures(trace: Trace, step: StepRecord | None) -> dict[str, Any]:
    """The ``peak_*``, ``categories`` and ``accounted_fraction`` keys of the summary."""
    if step is None:
        return {
            "peak_step": None,
            "peak_memory_bytes": None,
            "peak_source": None,
            "peak_from_incomplete_step": False,
            "peak_from_warmup_step": False,
            "peak_phase": None,
            "peak_module": None,
            "peak_t_ms": None,
            "categories": dict.fromkeys(CATEGORIES),
            "accounted_fraction": None,
        }
    peak = step_peak_bytes(step)
    cats = categories_at_peak(step)
    accounted = sum(cats[c] or 0 for c in ACCOUNTED)
    mem = step.memory
    return {
        "peak_step": step.step,
        "peak_memory_bytes": peak,
        "peak_source": mem.get("peak_source") or ("allocator" if _has_allocator(step) else "accounting"),
        "peak_from_incomplete_step": not step.complete,
        "peak_from_warmup_step": step.warmup,
        "peak_phase": peak_phase(step),
        "peak_module": module_label(trace, mem.get("peak_model"), mem.get("peak_module")),
        "peak_t_ms": mem.get("peak_t_ms"),
        "categories": cats,
        "accounted_fraction": round(accounted / peak, 4) if peak else None,
    }


# ----------------------------------------------------------------------------------------- steps


def peak_step(trace: Trace) -> StepRecord | None:
    """The detailed profiled step with the highest peak (timing steps carry no ledger); without
    profiled steps, any step (incomplete too)."""
    pool = trace.detailed_steps() or trace.profiled_steps() or trace.steps
    return max(pool, key=step_peak_bytes, default=None)


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
    return [sum(int(v or 0) for v in vals) for vals in zip(*_category_columns(step).values(), strict=False)]


def _category_columns(step: StepRecord) -> dict[str, list[Any]]:
    n = len(step.timeline.get("t_ms") or [])
    return {c: list(step.timeline.get(c) or [None] * n) for c in ACCOUNTED}


def categories_at_peak(step: StepRecord) -> dict[str, int | None]:
    """Bytes per category at the step's peak; from the timeline when the record lacks them."""
    cats = step.memory.get("categories_at_peak")
    if isinstance(cats, dict):
        return {c: _opt_int(cats.get(c)) for c in CATEGORIES}
    totals = _sample_totals(step)
    if not totals:
        return dict.fromkeys(CATEGORIES)
    i = max(range(len(totals)), key=lambda k: totals[k] or 0)
    out: dict[str, int | None] = {c: _opt_int(col[i]) for c, col in _category_columns(step).items()}
    out["other"] = None
    return out


def median_phases(steps: list[StepRecord]) -> dict[str, float]:
    """Median milliseconds per phase over ``steps``; the standard phases first, then any others."""
    names = list(PHASES) + sorted({k for s in steps for k in s.phases_ms} - set(PHASES))
    out = {p: _median([s.phases_ms.get(p) for s in steps]) for p in names}
    return {p: v for p, v in out.items() if v is not None}


def step_rows(trace: Trace) -> list[dict[str, Any]]:
    """One row per step record, in order: timing, phases, and where its peak happened."""
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
            "peak_module": module_label(trace, s.memory.get("peak_model"), s.memory.get("peak_module")),
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
        "categories": {c: [int(v or 0) for v in col][k:] for c, col in _category_columns(step).items()},
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


# ----------------------------------------------------------------------------------------- modules


def model_by_index(trace: Trace, index: Any) -> ModelInfo | None:
    return next((m for m in trace.models if m.index == index), None)


def module_label(trace: Trace, model: Any, module: Any) -> str | None:
    """A module's display name; ``model{i}:`` is prefixed only when the trace has several models."""
    info = model_by_index(trace, model if model is not None else 0)
    if info is None or not isinstance(module, int) or not 0 <= module < len(info.names):
        return None
    return _prefix(trace, info) + info.display_name(module)


def _prefix(trace: Trace, info: ModelInfo) -> str:
    return f"model{info.index}:" if len(trace.models) > 1 else ""


def depths(info: ModelInfo) -> list[int]:
    """Depth of every module (the root is 0); parents come before children in ``named_modules()`` order."""
    out: list[int] = []
    for parent in info.parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def children(info: ModelInfo) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in info.names]
    for i, parent in enumerate(info.parents):
        if parent >= 0:
            kids[parent].append(i)
    return kids


def module_columns(info: ModelInfo, step: StepRecord | None) -> dict[str, list[Any]]:
    """The step's per-module columns for this model, padded with ``None`` where missing or short."""
    n = len(info.names)
    cols = (step.modules.get(info.index) if step else None) or {}
    return {k: (list(cols[k]) + [None] * n)[:n] if k in cols else [None] * n for k in MODULE_COLUMNS}


def subtree_sums(info: ModelInfo, values: list[Any]) -> list[int]:
    """Inclusive totals of an exclusive per-module column (children follow their parent in order)."""
    out = [int(v or 0) for v in values]
    for i in range(len(out) - 1, 0, -1):
        if info.parents[i] >= 0:
            out[info.parents[i]] += out[i]
    return out


def layer_table(trace: Trace, step: StepRecord | None) -> list[dict[str, Any]]:
    """Every module of every model, in model order, with own and inclusive figures for ``step``."""
    rows: list[dict[str, Any]] = []
    for info in trace.models:
        rows += _model_rows(trace, info, step)
    return rows


def _model_rows(trace: Trace, info: ModelInfo, step: StepRecord | None) -> list[dict[str, Any]]:
    cols = module_columns(info, step)
    own = {"parameters": info.param_bytes, **{c: cols[k] for c, k in _OWN_COLUMNS.items()}}
    incl = {c: subtree_sums(info, v) for c, v in own.items()}
    level = depths(info)
    return [
        {
            "model": info.index,
            "index": i,
            "name": _prefix(trace, info) + info.display_name(i),
            "type": info.types[i],
            "depth": level[i],
            "param_bytes": info.param_bytes[i],
            "grad_bytes": _opt_int(cols["grad_bytes"][i]),
            "optimizer_state_bytes": _opt_int(cols["optimizer_state_bytes"][i]),
            "activation_bytes": _opt_int(cols["activation_bytes"][i]),
            "activation_self_bytes": _opt_int(cols["activation_self_bytes"][i]),
            "checkpoint_free_bytes": _opt_int(cols["checkpoint_free_bytes"][i]),
            "forward_ms": _opt_float(cols["forward_ms"][i]),
            "backward_ms": _opt_float(cols["backward_ms"][i]),
            "calls": _opt_int(cols["calls"][i]),
            "grad_norm": _opt_float(cols["grad_norm"][i]),
            "inclusive": {c: incl[c][i] for c in incl},
        }
        for i in range(len(info.names))
    ]


_SUMMARY_LAYER_KEYS = (
    *("name", "type", "model", "depth", "param_bytes", "grad_bytes", "optimizer_state_bytes"),
    *("activation_bytes", "checkpoint_free_bytes", "forward_ms", "backward_ms", "grad_norm"),
)


def summary_layers(trace: Trace, step: StepRecord | None) -> list[dict[str, Any]]:
    return [{k: row[k] for k in _SUMMARY_LAYER_KEYS} for row in layer_table(trace, step)]


# ----------------------------------------------------------------------------------------- top-level layers


def top_layers(trace: Trace, step: StepRecord | None, limit: int = TOP_LAYERS) -> list[dict[str, Any]]:
    """The layers a bar chart shows, in model order: ``{name, parameters, gradients, ...}`` bytes each.

    Per model: walk down from the root while one child holds more than 80% of its parent's bytes (a
    wrapper such as ``BertForSequenceClassification.bert``), take that module's children and the
    siblings passed on the way, and open any of them that is (or wraps) a stack of repeated blocks
    (``encoder.layer.0..11``). Modules passed on the way down that own bytes themselves (parameters,
    or activations of their own ops) show as ``name (own)`` when that is at least 1% of the model.
    The biggest ``limit - 1`` bars are kept when there are more; the rest become one ``other`` bar.
    """
    bars: list[dict[str, Any]] = []
    for info in trace.models:
        rows = _model_rows(trace, info, step)
        floor = OWN_BAR_SHARE * _totals(rows)[0]
        picked = [_bar(rows[i], own) for i, own in _top_modules(info, rows)]
        bars += [b for b in picked if b["total"] > (floor if b["own"] else 0)]
    return _group_rest(bars, limit)


def top_layer_modules(trace: Trace, step: StepRecord | None) -> list[tuple[ModelInfo, int]]:
    """The layers of ``top_layers`` that cover a whole subtree (not the "(own)" bars), as ``(model,
    module index)`` in model order, none grouped: the rows of the layer x time heatmap."""
    out: list[tuple[ModelInfo, int]] = []
    for info in trace.models:
        rows = _model_rows(trace, info, step)
        out += [(info, i) for i, own in _top_modules(info, rows) if not own]
    return out


def _totals(rows: list[dict[str, Any]]) -> list[int]:
    return [sum(r["inclusive"].values()) + (r["activation_bytes"] or 0) for r in rows]


def _top_modules(info: ModelInfo, rows: list[dict[str, Any]]) -> list[tuple[int, bool]]:
    """``(module index, own_only)`` pairs covering the model, in model order."""
    kids, totals = children(info), _totals(rows)
    picked: list[tuple[int, bool]] = []
    node = 0
    while (nxt := _dominant_child(node, kids, totals)) is not None:
        picked += [(node, True)] + [(k, False) for k in kids[node] if k != nxt]
        node = nxt
    picked += [(node, True)] if kids[node] else [(node, False)]
    for k in kids[node]:
        picked += _open_blocks(k, kids, totals, info.types)
    return sorted(picked)


def _dominant_child(node: int, kids: list[list[int]], totals: list[int]) -> int | None:
    big = max(kids[node], key=lambda k: totals[k], default=None)
    if big is None or totals[node] <= 0 or totals[big] <= DOMINANT_SHARE * totals[node]:
        return None
    return big


def _open_blocks(
    node: int, kids: list[list[int]], totals: list[int], types: list[str]
) -> list[tuple[int, bool]]:
    """The repeated blocks under ``node`` (through single dominant wrappers), or ``node`` itself."""
    path, cur = [node], node
    while not _is_block_stack(cur, kids, types) and (nxt := _dominant_child(cur, kids, totals)) is not None:
        path.append(nxt)
        cur = nxt
    if not _is_block_stack(cur, kids, types):
        return [(node, False)]
    return [(p, True) for p in path] + [(k, False) for k in kids[cur]]


def _is_block_stack(node: int, kids: list[list[int]], types: list[str]) -> bool:
    """Most children are composite modules of one class: ``layer.0``, ``layer.1``, ... (not leaf layers)."""
    blocks = [k for k in kids[node] if kids[k]]
    if len(blocks) < 2:
        return False
    common = max(sum(types[k] == types[j] for j in blocks) for k in blocks)
    return common >= 2 and common * 2 > len(kids[node])


def _bar(row: dict[str, Any], own_only: bool) -> dict[str, Any]:
    if own_only:
        values = {
            "parameters": row["param_bytes"],
            "gradients": row["grad_bytes"] or 0,
            "optimizer_state": row["optimizer_state_bytes"] or 0,
            "activations": row["activation_self_bytes"] or 0,
        }
    else:
        values = {**row["inclusive"], "activations": row["activation_bytes"] or 0}
    name = row["name"] + (" (own)" if own_only else "")
    total = sum(values.values())
    return {"name": name, "type": row["type"], "own": own_only, "layers": 1, **values, "total": total}


def _group_rest(bars: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(bars) <= limit:
        return bars
    keep = set(sorted(range(len(bars)), key=lambda i: -bars[i]["total"])[: limit - 1])
    rest = [b for i, b in enumerate(bars) if i not in keep]
    other: dict[str, Any] = {"name": f"other ({len(rest)} layers)", "type": "", "own": False}
    other["layers"] = len(rest)
    for key in (*ACCOUNTED, "total"):
        other[key] = sum(b[key] for b in rest)
    return [b for i, b in enumerate(bars) if i in keep] + [other]


# ----------------------------------------------------------------------------------------- gradient norms

VANISHING_RATIO = 1e3  # a block this many times below the median of its neighbours is flagged
VANISHING_NEIGHBOURS = 2  # blocks compared on each side
EXPLODING_RATIO = 1e3  # a step's global norm this many times the other steps' median is flagged
EXPLODING_NORM = 1e4  # and so is a global norm above this
GRAD_CHART_STEPS = 8


def grad_norm_steps(trace: Trace) -> list[StepRecord]:
    """Complete steps that measured gradient norms (warm-up steps included), in order; not the steps a
    GradScaler skipped (their Inf/NaN gradients never reached the weights: see ``scaler_skip_flags``)."""
    return [s for s in trace.steps if s.complete and _has_grad_norms(s) and not scaler_skipped(s)]


def scaler_skipped(step: StepRecord) -> bool:
    """Whether a ``torch.amp.GradScaler`` skipped this step's optimizer step."""
    return bool(step.grad_scaler and step.grad_scaler.get("skipped"))


def _has_grad_norms(step: StepRecord) -> bool:
    return any("grad_norm" in cols for cols in step.modules.values())


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


def grad_norm_series(trace: Trace) -> list[dict[str, Any]]:
    """The global gradient norm per step that measured it (``null``: NaN or Inf)."""
    return [
        {"step": s.step, "global": (step_grad_norm(s) or {}).get("global")} for s in grad_norm_steps(trace)
    ]


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


def repeated_blocks(info: ModelInfo) -> list[list[int]]:
    """Stacks of three or more sibling modules of one class that hold parameters (``encoder.layer.0..11``,
    the ``Linear`` layers of an MLP), in model order; a stack inside a block of another is left out."""
    kids, params = children(info), subtree_sums(info, info.param_bytes)
    groups: list[list[int]] = []
    covered: set[int] = set()
    for node in range(len(info.names)):
        if node in covered:
            covered.update(kids[node])
            continue
        by_type: dict[str, list[int]] = {}
        for k in kids[node]:
            if params[k] > 0:
                by_type.setdefault(info.types[k], []).append(k)
        for group in (g for g in by_type.values() if len(g) >= 3):
            groups.append(group)
            covered.update(group)
    return groups


def grad_flags(trace: Trace) -> list[dict[str, Any]]:
    """Every gradient-norm finding, ``{kind, module, step, evidence}``: each kind and module once, at the
    first step it showed in, with how many of the measured steps showed it."""
    measured = len(grad_norm_steps(trace))
    return scaler_skip_flags(trace) + [f for rule in GRAD_RULES for f in _once(rule(trace), measured)]


def nonfinite_flags(trace: Trace) -> list[dict[str, Any]]:
    """NaN or Inf gradients. The optimizer step writes them into the weights, and the loss turns NaN from
    then on. The module named is the first whose gradient was non-finite in backward order, where the
    NaN or Inf appeared: backward carries it from there to the modules before it, which show it too."""
    out = []
    for s in grad_norm_steps(trace):
        g = step_grad_norm(s)
        if g and g["first_nonfinite"]:
            n, where = len(g["nonfinite_modules"]), module_label(trace, *g["first_nonfinite"])
            text = f"NaN/Inf gradient in {n} module{'' if n == 1 else 's'}; it appeared first in {where}"
            out.append(_grad_flag("nonfinite", where, s.step, text))
    return out


def exploding_flags(trace: Trace) -> list[dict[str, Any]]:
    """Exploding gradients: a step whose global gradient norm is above ``EXPLODING_NORM`` (1e4), or
    ``EXPLODING_RATIO`` (1000) times the median of the other steps' or more. One such step can throw the
    weights far off; gradient clipping (``clip_grad_norm_``) or a lower learning rate are the usual cures.
    The module named holds the largest gradient norm of that step."""
    norms = {r["step"]: r["global"] for r in grad_norm_series(trace)}
    out = []
    for s in grad_norm_steps(trace):
        others = [v for k, v in norms.items() if k != s.step and v is not None]
        reason = _exploding_reason(norms[s.step], statistics.median(others) if others else None)
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


def vanishing_flags(trace: Trace) -> list[dict[str, Any]]:
    """Vanishing gradients: a block of a repeated stack (``encoder.layer.4`` of ``layer.0..11``) whose
    gradient norm, over all its submodules, is ``VANISHING_RATIO`` (1000) times or more below the median
    of its neighbours (up to two blocks on each side). Its weights barely learn; look for what cuts the
    gradient there (a saturated activation, a detach, a residual path that skips it, a bad init)."""
    out = []
    for s in grad_norm_steps(trace):
        for info in trace.models:
            out += _vanishing_in(trace, info, s)
    return out


def _vanishing_in(trace: Trace, info: ModelInfo, step: StepRecord) -> list[dict[str, Any]]:
    norms = inclusive_grad_norms(info, module_columns(info, step))
    out = []
    for blocks in repeated_blocks(info):
        for k, i in enumerate(blocks):
            near = blocks[max(0, k - VANISHING_NEIGHBOURS) : k] + blocks[k + 1 : k + 1 + VANISHING_NEIGHBOURS]
            values = [v for v in (norms[j] for j in near) if v is not None]
            value = norms[i]
            if value is None or not values or value * VANISHING_RATIO > statistics.median(values):
                continue
            med, name = statistics.median(values), module_label(trace, info.index, i)
            ratio = f"{med / value:.3g}x" if value > 0 else "infinitely"
            text = f"gradient norm {value:.3g}, {ratio} below the median of its neighbours ({med:.3g})"
            out.append(_grad_flag("vanishing", name, step.step, text))
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
        return [(info, i, True, _prefix(trace, info) + info.display_name(i)) for info, i in owners]
    out = []
    step = peak_step(trace)
    for info in trace.models:
        params = subtree_sums(info, info.param_bytes)
        for i, own in _top_modules(info, _model_rows(trace, info, step)):
            if (info.param_bytes[i] if own else params[i]) > 0:
                suffix = " (own)" if own and children(info)[i] else ""
                out.append((info, i, own, _prefix(trace, info) + info.display_name(i) + suffix))
    return out


def _layer_norms(step: StepRecord, layers: list[tuple[ModelInfo, int, bool, str]]) -> list[float | None]:
    out: list[float | None] = []
    cache: dict[int, tuple[dict[str, list[Any]], list[float | None]]] = {}
    for info, i, own, _ in layers:
        if info.index not in cache:
            cols = module_columns(info, step)
            cache[info.index] = (cols, inclusive_grad_norms(info, cols))
        cols, incl = cache[info.index]
        out.append(_opt_float(cols["grad_norm"][i]) if own else incl[i])
    return out


# ----------------------------------------------------------------------------------------- faults


def fault_info(trace: Trace) -> dict[str, Any] | None:
    """How the run died, or ``None`` when it ended normally: from the end record and the last fault event."""
    end = trace.end or {}
    event = next((e for e in reversed(trace.events) if e.get("kind") in _FAULT_EVENT_KINDS), None)
    if not _is_fault(end, event, _dying_step(trace)):
        return None
    event = event or {}
    where = _last_sample_where(trace)
    return {
        "kind": end.get("status") or event.get("kind") or "unknown",
        "message": event.get("message") or end.get("message") or "",
        "exception_type": event.get("exception_type"),
        "signal": end.get("signal"),
        "exit_code": end.get("exit_code"),
        # An event with a null step: the script died before its first training step.
        "step": event["step"] if "step" in event else where.get("step"),
        "phase": _first(event.get("phase"), where.get("phase")),
        "module_name": _first(_event_module(trace, event), where.get("module_name")),
    }


def _is_fault(end: dict[str, Any], event: dict[str, Any] | None, dying: StepRecord | None) -> bool:
    status = end.get("status")
    if status is None:
        return (event is not None and event.get("kind") != "script_exit") or bool(dying)
    if status == "script_exit":
        return end.get("exit_code") not in (0, None)
    return status not in _NORMAL_STATUSES


def _event_module(trace: Trace, event: dict[str, Any]) -> str | None:
    label = module_label(trace, event.get("model"), event.get("module"))
    name = event.get("module_name")
    if label is None and name is not None and len(trace.models) > 1 and event.get("model") is not None:
        return f"model{event['model']}:{name}"
    return label or name


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _dying_step(trace: Trace) -> StepRecord | None:
    return next((s for s in reversed(trace.steps) if not s.complete), None)


def _last_sample_where(trace: Trace) -> dict[str, Any]:
    live = live_at_fault(trace)
    if live is None:
        return {}
    stack = live["module_stack"]
    return {"step": live["step"], "phase": live["phase"], "module_name": stack[-1] if stack else None}


def live_at_fault(trace: Trace) -> dict[str, Any] | None:
    """The last timeline sample of the step the run died in: what was live, and which modules were running."""
    step = _dying_step(trace)
    t_ms = (step.timeline.get("t_ms") or []) if step else []
    if step is None or not t_ms:
        return None
    i = len(t_ms) - 1
    tl = step.timeline
    cats = {c: _opt_int(col[i]) for c, col in _category_columns(step).items()}
    return {
        "step": step.step,
        "t_ms": float(t_ms[i]),
        "event": _at(tl.get("event"), i),
        "phase": _at(tl.get("phase"), i),
        "categories": cats,
        "allocator": {c: _opt_int(_at(tl.get(c), i)) for c in _ALLOCATOR_COLUMNS if tl.get(c) is not None},
        "module_stack": module_stack(trace, _at(tl.get("model"), i), _at(tl.get("module"), i)),
    }


def _at(col: list[Any] | None, i: int) -> Any:
    return col[i] if col is not None and i < len(col) else None


def module_stack(trace: Trace, model: Any, module: Any) -> list[str]:
    """Display names from the root down to ``module`` (empty when unknown)."""
    info = model_by_index(trace, model if model is not None else 0)
    if info is None or not isinstance(module, int) or not 0 <= module < len(info.names):
        return []
    chain = [module]
    while info.parents[chain[-1]] >= 0 and len(chain) <= len(info.names):
        chain.append(info.parents[chain[-1]])
    return [_prefix(trace, info) + info.display_name(i) for i in reversed(chain)]


def event_row(trace: Trace, event: dict[str, Any]) -> dict[str, Any]:
    """The fields of an event that the summary keeps (tracebacks stay in the trace)."""
    return {
        "kind": event.get("kind"),
        "message": event.get("message", ""),
        "exception_type": event.get("exception_type"),
        "step": event.get("step"),
        "phase": event.get("phase"),
        "module_name": _event_module(trace, event),
        "t_unix": event.get("t_unix"),
    }


# ----------------------------------------------------------------------------------------- headline

_FAULT_WORDS = {
    "oom": "out of memory",
    "exception": "an exception",
    "crashed": "a crash",
    "killed": "a signal",
    "unknown": "an unknown cause (the trace has no end record)",
}


def headline(summary: dict[str, Any]) -> str:
    """The report's one-sentence verdict, from the summary's own figures."""
    fault = summary.get("fault")
    if fault:
        return fault_sentence(summary, fault)
    if summary.get("peak_memory_bytes") is None:
        return "No optimizer step was recorded, so there is no memory figure to report."
    return peak_sentence(summary)


def peak_sentence(summary: dict[str, Any]) -> str:
    """E.g. ``Peak 11.40 GiB of 8.00 GiB budget: 62% of it activations.``"""
    peak = summary["peak_memory_bytes"]
    text = f"Peak {format_bytes(peak)}"
    limit, kind = memory_limit(summary)
    if limit:
        name = summary["device"].get("name") or "GPU"
        text += f" of {format_bytes(limit)} " + (f"on the {name}" if kind == "device memory" else kind)
        if peak > limit:
            text += f" ({format_bytes(peak - limit)} over)"
    cats = {k: v for k, v in summary["categories"].items() if v}
    if not cats or not peak:
        return text + "."
    top = max(cats, key=lambda k: cats[k])
    return text + f": {round(100 * cats[top] / peak)}% of it {CATEGORY_LABELS[top].split(' (')[0]}."


def memory_limit(summary: dict[str, Any]) -> tuple[int | None, str]:
    """The line the peak is judged against: the budget, else the memory cap, else a GPU's total memory.

    Returns ``(bytes, kind)`` with kind ``"budget"``, ``"memory cap"`` or ``"device memory"``.
    """
    device = summary["device"]
    if summary.get("budget_bytes"):
        return summary["budget_bytes"], "budget"
    if device.get("memory_cap_bytes"):
        return device["memory_cap_bytes"], "memory cap"
    if device.get("kind") == "cuda" and device.get("total_memory_bytes"):
        return device["total_memory_bytes"], "device memory"
    return None, ""


def fault_sentence(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    """E.g. ``The script died of CUDA out of memory at step 0, in the backward of encoder.layer.11, ...``"""
    text = _fault_subject(summary, fault)
    complete = sum(1 for row in summary.get("steps") or [] if row.get("complete"))
    if fault.get("step") is not None:
        text += f" at step {fault['step']}"
    elif fault.get("kind") in ("exception", "oom", "script_exit", "interrupted"):
        text += " before its first training step"  # the script said where: in no step yet
    else:  # a hard death: no Python frame said where
        text += f" after {complete} complete step{'s' if complete != 1 else ''}"
    text += _fault_place(fault)
    return text + _fault_memory(summary) + "."


def _fault_memory(summary: dict[str, Any]) -> str:
    """``, with 7.62 GiB allocated (budget 8.00 GiB)`` from the last sample before the fault."""
    live = summary.get("live_at_fault") or {}
    held = (live.get("allocator") or {}).get("allocated")
    text = f", with {format_bytes(held)} allocated" if held else ""
    if not held and live.get("categories"):
        held = sum(v or 0 for v in live["categories"].values())
        text = f", with {format_bytes(held)} in tensors" if held else ""
    limit, kind = memory_limit(summary)
    return text + (f" ({kind} {format_bytes(limit)})" if text and limit else "")


def _fault_subject(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    """``The script died of ...``, or the verb that fits a run that was stopped rather than died."""
    kind, signal = fault.get("kind"), fault.get("signal")
    if kind == "interrupted":
        return "The run was interrupted (Ctrl-C)"
    if kind == "script_exit":
        return f"The script called sys.exit({fault.get('exit_code')})"
    if kind == "killed" and signal:
        return f"The script was killed by {signal}"
    return f"The script died of {_fault_cause(summary, fault)}"


def _fault_cause(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    kind = fault.get("kind")
    if kind == "oom":
        return "CUDA out of memory" if summary["device"].get("kind") == "cuda" else "out of memory"
    if fault.get("exception_type"):
        return str(fault["exception_type"])
    if kind == "crashed" and fault.get("signal"):
        return f"a crash ({fault['signal']})"
    if kind == "crashed" and fault.get("exit_code") is not None:
        return f"an abrupt exit with code {fault['exit_code']} (os._exit, or native code ending the process)"
    return _FAULT_WORDS.get(str(kind), str(kind or "an unknown cause"))


def _fault_place(fault: dict[str, Any]) -> str:
    phase, module = fault.get("phase"), fault.get("module_name")
    if phase in ("forward", "backward"):
        return f", in the {phase} of {module}" if module else f", in the {phase} pass"
    if phase == "optimizer":
        return ", in the optimizer step"
    return f", in {module}" if module else ""


# ----------------------------------------------------------------------------------------- numbers


def _median(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if v is not None]
    return round(statistics.median(nums), 3) if nums else None


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
