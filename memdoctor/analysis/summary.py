"""What a trace measured, as plain data: ``summary.json``'s figures.

``summary_figures`` gathers the run-wide figures (peak, categories, steps, layers, fault, gradient norms)
and lets every module of ``SECTIONS`` add its keys, in order. The plan (``memdoctor.plan.summarize``)
reads them and adds its own, and the headline comes last: ``memdoctor.report.build_summary`` assembles
the whole ``summary.json``, because analysis may not import the plan.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from memdoctor.analysis import compiled, data, devicefacts, flops, histograms, precision, transfers, verified
from memdoctor.analysis.faults import event_row, fault_info, live_at_fault
from memdoctor.analysis.gradnorms import grad_flags, grad_norm_series
from memdoctor.analysis.layers import (
    ACCOUNTED,
    ENGINE_CATEGORIES,
    module_label,
    outside_holders,
    summary_layers,
)
from memdoctor.analysis.numbers import median
from memdoctor.analysis.steps import (
    categories_at_peak,
    median_phases,
    peak_step,
    step_peak_bytes,
    step_rows,
    steps_found,
)
from memdoctor.trace import CATEGORIES, StepRecord, Trace
from memdoctor.version import __version__

SUMMARY_FORMAT_VERSION = 1
# Events ``summary.json`` and the report list: the first and the last half of these, and a count of the
# rest (``events_left_out``); the trace keeps them all. A run that logs a million warnings would
# otherwise give a report of hundreds of megabytes.
EVENT_ROWS = 1000
# The collectors' modules that add ``summary.json`` keys, in order: each has ``summarize(trace,
# summary)``, which adds its keys (null where the trace did not measure them).
SECTIONS: tuple[ModuleType, ...] = (
    devicefacts,
    flops,
    data,
    transfers,
    histograms,
    precision,
    verified,
    compiled,
)


def summary_figures(trace: Trace) -> dict[str, Any]:
    """``summary.json`` less the plan and the headline: the peak figures, the fault (if any), every
    module, and the keys of each of ``SECTIONS``."""
    step = peak_step(trace)
    summary: dict[str, Any] = {
        "format_version": SUMMARY_FORMAT_VERSION,
        "memdoctor_version": __version__,
        "trace_memdoctor_version": trace.header.get("memdoctor_version"),
        "status": (trace.end or {}).get("status", "unknown"),
        "status_message": (trace.end or {}).get("message"),
        "device": device_info(trace),
        "budget_bytes": trace.settings.get("budget_bytes"),
        "gpu": trace.settings.get("gpu"),  # the card profiled for (``--gpu``), a memdoctor.cards key
        "not_measured": not_measured(trace),
        "steps_profiled": len(trace.profiled_steps()),
        "steps_found": steps_found(trace),
        "step_time_ms": median([s.duration_ms for s in unperturbed(trace.profiled_steps())]),
        "phases_ms": median_phases(trace.detailed_steps()),
        **peak_figures(trace, step),
        "layers": summary_layers(trace, step),
        "outside_modules": outside_holders(trace, step),
        "steps": step_rows(trace),
        "events": [event_row(trace, trace.events[i]) for i in shown_events(len(trace.events))],
        "events_left_out": max(0, len(trace.events) - EVENT_ROWS),
        "fault": fault_info(trace),
        "live_at_fault": live_at_fault(trace),
        "peak_ledger": peak_ledger(trace, step),
        "grad_norm": grad_norm_series(trace),
        "grad_flags": grad_flags(trace),
    }
    for section in SECTIONS:
        section.summarize(trace, summary)
    return summary


def shown_events(n: int, rows: int = EVENT_ROWS) -> list[int]:
    """The indices of the events listed of ``n``: all up to ``rows``, else the first and the last
    ``rows // 2`` (the run's start, and how it ended)."""
    if n <= rows:
        return list(range(n))
    return [*range(rows // 2), *range(n - (rows - rows // 2), n)]


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
    flops_note = (trace.collected.get("flops") or {}).get("not_measured")
    if isinstance(flops_note, str):  # the counter stepped aside (a torch.compile'd training step)
        notes.append(f"flops: not measured in {flops_note}")
    notes += [
        str(e.get("message"))
        for e in trace.events
        if e.get("kind") == "collector_failed" and e.get("message") not in notes
    ]
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
    accounted = sum(cats.get(c) or 0 for c in (*ACCOUNTED, *ENGINE_CATEGORIES))
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
