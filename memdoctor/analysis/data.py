"""The data section: how long the loop waited for batches, and what the batches looked like.

Reads ``step.collectors.data`` (``memdoctor.capture.dataloader``) of the profiled steps. Pure and
defensive: the figures come from a file, so anything of the wrong type is skipped, never trusted.

* ``dataloader_wait_fraction``: the loop's wait inside DataLoader fetches over the step time. On CUDA
  a fetch can hide behind GPU work still queued, so the verdict "the GPU is starving" rests on the
  device-idle part of the wait (``device_wait_ms``) where it was measured.
* ``padding_fraction``: padded positions over all token positions of the profiled steps' token batches.
* ``data``: per-step shapes, length percentiles, the largest batch, and the data-traits class that
  places the run on the nine-grid's data axis.
"""

from __future__ import annotations

import math
from typing import Any

from memdoctor.trace import StepRecord, Trace

STARVING_FRACTION = 0.10  # of the step time, the device idle while the loop waits for data
PADDING_NOTABLE = 0.05  # below this, padding is noise
PADDING_HIGH = 0.30
PERCENTILES = (50, 90, 99)
NO_DATA = (
    "this trace has no data-loader or batch measurements (recorded without the data collector, "
    "e.g. by an earlier memdoctor)"
)


# ----------------------------------------------------------------------------------------- summary


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``dataloader_wait_fraction``, ``padding_fraction`` and ``data`` (null when not measured)."""
    steps = _data_steps(trace.profiled_steps())
    wait = wait_figures(steps)
    # Batch traits from the profiled steps; a run that died before completing one (an OOM at step 0)
    # still fetched and measured the batch it died on: use every step then, and say so.
    traits_steps = steps if any(_batches(d) for _, d in steps) else _data_steps(trace.steps)
    batches = [(s.step, b) for s, d in traits_steps for b in _batches(d)]
    summary["dataloader_wait_fraction"] = wait["fraction"] if wait else None
    summary["padding_fraction"] = padding_fraction([b for _, b in batches])
    if not steps and not _data_steps(trace.steps):
        summary["data"] = None
        return
    lengths = [n for _, b in batches for n in _ints(b.get("lengths"))]
    summary["data"] = {
        "source": _source(steps),
        "lookahead": _facts(trace).get("lookahead"),
        "wait": wait,
        "steps": [_step_row(s, d) for s, d in steps],
        "lengths": percentiles(lengths),
        "largest_batch": largest_batch(batches),
        "traits": traits_class(batches, summary["padding_fraction"], lengths),
        "batches_from": "profiled steps" if traits_steps is steps else "every recorded step (none profiled)",
        "incomplete_step": _incomplete(trace),
        "not_measured": data_not_measured(trace, steps),
    }


def _data_steps(steps: list[StepRecord]) -> list[tuple[StepRecord, dict[str, Any]]]:
    return [(s, s.collectors["data"]) for s in steps if isinstance(s.collectors.get("data"), dict)]


def _facts(trace: Trace) -> dict[str, Any]:
    facts = trace.collected.get("data")
    return facts if isinstance(facts, dict) else {}


def _batches(data: dict[str, Any]) -> list[dict[str, Any]]:
    found = data.get("batches")
    return [b for b in found if isinstance(b, dict)] if isinstance(found, list) else []


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _nonneg_int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def _ints(xs: Any) -> list[int]:
    return [x for x in xs if _nonneg_int(x) is not None] if isinstance(xs, list) else []


def _shapes(batch: dict[str, Any]) -> dict[str, list[int]]:
    raw = batch.get("shapes")
    if not isinstance(raw, dict):
        return {}
    return {str(k): _ints(v) for k, v in raw.items() if isinstance(v, list)}


def _source(steps: list[tuple[StepRecord, dict[str, Any]]]) -> str | None:
    found = {d.get("source") for _, d in steps} & {"dataloader", "forward"}
    return "dataloader" if "dataloader" in found else found.pop() if found else None


# ----------------------------------------------------------------------------------------- wait


def wait_figures(steps: list[tuple[StepRecord, dict[str, Any]]]) -> dict[str, Any] | None:
    """Wait over step time across the steps that timed fetches; None when no DataLoader was seen."""
    timed = [(s, d) for s, d in steps if _nonneg_int(d.get("fetches")) is not None]
    if not any(d["fetches"] for _, d in timed):
        return None
    rows: list[tuple[float, float, float | None]] = []
    for s, d in timed:
        dur, w = _num(s.duration_ms), _num(d.get("wait_ms"))
        if dur and dur > 0 and w is not None:
            rows.append((dur, w, _num(d.get("device_wait_ms"))))
    total = sum(dur for dur, _, _ in rows)
    waited = sum(w for _, w, _ in rows)
    device = [dev for _, _, dev in rows if dev is not None]
    fraction = min(1.0, waited / total) if total else None
    device_fraction = min(1.0, sum(device) / total) if total and len(device) == len(rows) else None
    verdict = device_fraction if device_fraction is not None else fraction
    return {
        "fraction": _round(fraction),
        "device_idle_fraction": _round(device_fraction),
        "wait_ms_per_step": _round(waited / len(rows)) if rows else None,
        "starving": None if verdict is None else verdict >= STARVING_FRACTION,
    }


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def _step_row(step: StepRecord, data: dict[str, Any]) -> dict[str, Any]:
    batches = _batches(data)
    tokens, real = _token_sums(batches)
    return {
        "step": step.step,
        "duration_ms": step.duration_ms,
        "wait_ms": _num(data.get("wait_ms")),
        "device_wait_ms": _num(data.get("device_wait_ms")),
        "fetches": _nonneg_int(data.get("fetches")),
        "batches": _nonneg_int(data.get("batches_total")) or len(batches),
        "shapes": [_shapes(b) for b in batches],
        "tokens": tokens or None,
        "real_tokens": real if tokens else None,
        "padding_fraction": _round(1.0 - real / tokens) if tokens else None,
    }


# ----------------------------------------------------------------------------------------- tokens


def _token_sums(batches: list[dict[str, Any]]) -> tuple[int, int]:
    """Token positions and real tokens over the batches whose real lengths were measured."""
    tokens = real = 0
    for b in batches:
        t, r = _nonneg_int(b.get("tokens")), _nonneg_int(b.get("real_tokens"))
        if t and r is not None and r <= t:
            tokens, real = tokens + t, real + r
    return tokens, real


def padding_fraction(batches: list[dict[str, Any]]) -> float | None:
    """1 - real tokens / token positions over all token batches with real lengths; None without any."""
    tokens, real = _token_sums(batches)
    return _round(1.0 - real / tokens) if tokens else None


def percentile(sorted_values: list[int], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentiles(lengths: list[int]) -> dict[str, Any] | None:
    """``count, min, p50, p90, p99, max, mean`` of the real sequence lengths; None without any."""
    if not lengths:
        return None
    ordered = sorted(lengths)
    out: dict[str, Any] = {"count": len(ordered), "min": ordered[0], "max": ordered[-1]}
    out.update({f"p{q}": round(percentile(ordered, q), 3) for q in PERCENTILES})
    out["mean"] = round(sum(ordered) / len(ordered), 3)
    return out


def largest_batch(batches: list[tuple[int, dict[str, Any]]]) -> dict[str, Any] | None:
    """The batch with the most token positions (token batches) or tensor elements (others)."""
    if not batches:
        return None

    def size(item: tuple[int, dict[str, Any]]) -> tuple[int, int]:
        b = item[1]
        return _nonneg_int(b.get("tokens")) or 0, _nonneg_int(b.get("elements")) or 0

    step, b = max(batches, key=size)
    return {
        "step": step,
        "shapes": _shapes(b),
        "elements": _nonneg_int(b.get("elements")),
        "tokens": _nonneg_int(b.get("tokens")),
        "real_tokens": _nonneg_int(b.get("real_tokens")),
        "batch_size": _nonneg_int(b.get("batch_size")),
        "batch_dim": _nonneg_int(b.get("batch_dim")),
    }


# ----------------------------------------------------------------------------------------- traits


def traits_class(
    batches: list[tuple[int, dict[str, Any]]], padding: float | None, lengths: list[int]
) -> dict[str, Any]:
    """The nine-grid's data axis: ``class`` (``fixed-shape``, ``padded variable-length``, ``dynamic
    shapes``, or null when no batch was measured), ``level`` (``low``/``medium``/``high``: how much the
    batches' shapes waste or vary) and ``evidence`` (one sentence with the figures)."""
    signatures = {_signature(_shapes(b)) for _, b in batches} - {()}
    if not signatures:
        return {"class": None, "level": None, "evidence": "no batch with tensors was measured"}
    pad_text = _padding_text(padding, lengths)
    if len(signatures) > 1:
        level = "high" if padding is not None and padding >= PADDING_HIGH else "medium"
        evidence = f"{len(signatures)} different batch shapes in {len(batches)} batches{pad_text}"
        return {"class": "dynamic shapes", "level": level, "evidence": evidence}
    if padding is not None and padding >= PADDING_NOTABLE:
        level = "high" if padding >= PADDING_HIGH else "medium"
        evidence = f"every batch has the same shape, {shape_text(batches[0][1])}{pad_text}"
        return {"class": "padded variable-length", "level": level, "evidence": evidence}
    evidence = f"every batch has the same shape, {shape_text(batches[0][1])}{pad_text}"
    return {"class": "fixed-shape", "level": "low", "evidence": evidence}


def _signature(shapes: dict[str, list[int]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(sorted((k, tuple(v)) for k, v in shapes.items()))


def shape_text(batch: dict[str, Any]) -> str:
    return ", ".join(f"{k} {'×'.join(map(str, v)) or 'scalar'}" for k, v in _shapes(batch).items())


def _padding_text(padding: float | None, lengths: list[int]) -> str:
    if padding is None:
        return "; padding not measured (no attention mask, and no pad token id in the model's config)"
    text = f"; {100 * padding:.1f}% of the token positions are padding"
    stats = percentiles(lengths)
    if stats:
        text += f" (real lengths p50 {stats['p50']:g}, p90 {stats['p90']:g}, max {stats['max']})"
    return text


def _incomplete(trace: Trace) -> dict[str, Any] | None:
    """The batches of the step the script died in, if it was measured: what it was training on."""
    last = trace.steps[-1] if trace.steps else None
    if last is None or last.complete or not isinstance(last.collectors.get("data"), dict):
        return None
    batches = _batches(last.collectors["data"])
    return {"step": last.step, "shapes": [_shapes(b) for b in batches]} if batches else None


def data_not_measured(trace: Trace, steps: list[tuple[StepRecord, dict[str, Any]]]) -> list[str]:
    """What the data section could not measure in this run, and why."""
    facts = _facts(trace)
    notes = [str(n) for n in trace.header.get("not_measured", []) if str(n).startswith("data:")]
    if facts.get("why_not"):
        notes.append(f"data-loader wait: {facts['why_not']}")
    if facts.get("failure"):
        notes.append(f"data collector stopped after an error: {facts['failure']}")
    if steps and not any(_batches(d) for _, d in steps):
        notes.append("batch traits: no profiled step had a batch with tensors (DataLoader or model inputs)")
    return notes


# ----------------------------------------------------------------------------------------- lengths


def all_lengths(trace: Trace) -> list[int]:
    """Every real sequence length measured in the profiled steps (for the histogram)."""
    return [
        n
        for _, d in _data_steps(trace.profiled_steps())
        for b in _batches(d)
        for n in _ints(b.get("lengths"))
    ]


def padded_lengths(trace: Trace) -> list[int]:
    """The distinct padded lengths (token matrix widths) of the profiled steps' token batches."""
    out = set()
    for _, d in _data_steps(trace.profiled_steps()):
        for b in _batches(d):
            tokens, rows = _nonneg_int(b.get("tokens")), len(_ints(b.get("lengths")))
            if tokens and rows and not b.get("lengths_sampled") and tokens % rows == 0:
                out.add(tokens // rows)
    return sorted(out)
