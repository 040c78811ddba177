"""The "Host<->device transfers" section: what each step moved over PCIe, where, and what it cost.

Reads ``step.collectors["transfers"]`` of the profiled steps (see ``memdoctor.capture.transfers``)
and the ``device`` record's measured bandwidth. ``summarize`` adds ``h2d_bytes_per_step``,
``d2h_bytes_per_step`` (medians over the profiled steps) and the ``transfers`` object; all are null
when the trace did not measure transfers. ``link_figures``, ``pcie_samples`` and ``collector_notes``
are the rest of what the report's section shows.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from memdoctor.analysis.devicefacts import facts as device_facts
from memdoctor.trace import StepRecord, Trace

NAME = "transfers"
TOP = 10
READ_OPS = frozenset({"item", "tolist", "numpy", "bool", "float", "int"})
DIRECTIONS = ("h2d", "d2h")


def step_data(step: StepRecord) -> dict[str, Any] | None:
    """The step's transfer data when it has the expected shape (a trace is untrusted input)."""
    data = step.collectors.get(NAME)
    if not isinstance(data, dict) or not all(isinstance(data.get(d), dict) for d in DIRECTIONS):
        return None
    return data


def measured_steps(trace: Trace) -> list[tuple[StepRecord, dict[str, Any]]]:
    out = []
    for s in trace.profiled_steps():
        data = step_data(s)
        if data is not None:
            out.append((s, data))
    return out


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    steps = measured_steps(trace)
    summary["h2d_bytes_per_step"] = _median_int([_num(d["h2d"].get("bytes")) for _, d in steps])
    summary["d2h_bytes_per_step"] = _median_int([_num(d["d2h"].get("bytes")) for _, d in steps])
    summary["transfers"] = transfer_summary(trace, steps) if steps else None


def transfer_summary(trace: Trace, steps: list[tuple[StepRecord, dict[str, Any]]]) -> dict[str, Any]:
    rows = [_step_row(s.step, d) for s, d in steps]
    moved = sum(r["h2d_bytes"] + r["d2h_bytes"] for r in rows)
    pageable = sum(r["pageable_bytes"] for r in rows)
    device_ms = [r["device_ms"] for r in rows if r["device_ms"] is not None]
    return {
        "steps": rows,
        "host_ms_per_step": _median([r["host_ms"] for r in rows]),
        "device_ms_per_step": _median(device_ms) if device_ms else None,
        "pageable_share": pageable / moved if moved else None,
        "sync_reads_per_step": _median([r["sync_reads"] for r in rows]),
        "sync_reads": _by_where(trace, steps, reads=True),
        "biggest": _by_where(trace, steps, reads=False),
        "pcie": _pcie(d.get("pcie") for _, d in steps),
    }


def _step_row(step: int, data: dict[str, Any]) -> dict[str, Any]:
    h2d, d2h = data["h2d"], data["d2h"]
    dev = [_num(x.get("device_ms"), None) for x in (h2d, d2h)]
    known = [v for v in dev if v is not None]
    return {
        "step": step,
        "h2d_bytes": _num(h2d.get("bytes")),
        "d2h_bytes": _num(d2h.get("bytes")),
        "h2d_copies": _num(h2d.get("copies")),
        "d2h_copies": _num(d2h.get("copies")),
        "pageable_bytes": _num(h2d.get("pageable_bytes")) + _num(d2h.get("pageable_bytes")),
        "sync_reads": _num(data.get("sync_reads")),
        "host_ms": _num(h2d.get("host_ms")) + _num(d2h.get("host_ms")),
        "device_ms": sum(known) if known else None,
    }


def _by_where(
    trace: Trace, steps: list[tuple[StepRecord, dict[str, Any]]], *, reads: bool
) -> list[dict[str, Any]]:
    """Copies (or sync reads) grouped by where they happen, per step, largest first."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for _, data in steps:
        for row in _rows(data):
            if (row.get("op") in READ_OPS) != reads:
                continue
            where = _module_name(trace, row.get("model"), row.get("module"))
            key = (row.get("dir"), row.get("op"), row.get("site"), where, row.get("phase"), row.get("pinned"))
            g = groups.get(key)
            if g is None:
                g = groups[key] = _group(key, row)
            g["count"] += _num(row.get("count"), 1)
            g["bytes"] += _num(row.get("bytes"))
            g["host_ms"] += _num(row.get("host_ms"))
            g["device_ms"] += _num(row.get("device_ms"))
    n = len(steps)
    order = sorted(groups.values(), key=lambda g: (-(g["count"] if reads else g["bytes"]), str(g["site"])))
    return [_per_step(g, n) for g in order[:TOP]]


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The step's listed copies and its aggregated groups (which have a ``count`` and no ``site``)."""
    copies = data.get("copies")
    more = data.get("more")
    groups = more.get("groups") if isinstance(more, dict) else None
    rows = [r for r in (copies if isinstance(copies, list) else []) if isinstance(r, dict)]
    return rows + [g for g in (groups if isinstance(groups, list) else []) if isinstance(g, dict)]


def _group(key: tuple[Any, ...], row: dict[str, Any]) -> dict[str, Any]:
    direction, op, site, where, phase, pinned = key
    return {
        "dir": _text(direction),
        "op": _text(op),
        "site": _text(site),
        "module": where,
        "phase": _text(phase),
        "pinned": bool(pinned),
        "non_blocking": bool(row.get("non_blocking")),
        "count": 0,
        "bytes": 0,
        "host_ms": 0.0,
        "device_ms": 0.0,
    }


def _per_step(g: dict[str, Any], n: int) -> dict[str, Any]:
    out = {k: g[k] for k in ("dir", "op", "site", "module", "phase", "pinned", "non_blocking")}
    out["per_step"] = g["count"] / n
    out["bytes_per_step"] = g["bytes"] / n
    out["host_ms_per_step"] = round(g["host_ms"] / n, 4)
    out["device_ms_per_step"] = round(g["device_ms"] / n, 4)
    return out


def _pcie(fields: Any) -> dict[str, Any] | None:
    """Mean and max PCIe throughput over the steps that sampled it (bytes/s)."""
    valid = [f for f in fields if isinstance(f, dict)]
    if not valid:
        return None
    out: dict[str, Any] = {}
    for way in ("tx", "rx"):
        means = [_num(f.get(f"{way}_mean_bytes_per_s")) for f in valid]
        out[f"{way}_mean_bytes_per_s"] = int(sum(means) / len(means))
        out[f"{way}_max_bytes_per_s"] = max(_num(f.get(f"{way}_max_bytes_per_s")) for f in valid)
    return out


def _module_name(trace: Trace, model: Any, module: Any) -> str | None:
    for m in trace.models:
        if m.index == model and isinstance(module, int) and 0 <= module < len(m.names):
            return m.display_name(module)
    return None


# ----------------------------------------------------------------------------------------- report data


def collector_notes(trace: Trace) -> list[str]:
    """What the transfers collector said it could not measure (its run-wide record)."""
    rec = trace.collected.get(NAME)
    notes = rec.get("not_measured") if isinstance(rec, dict) else None
    return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []


def link_figures(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The measured bandwidth and the link's, and what the step's bytes cost at the measured rate."""
    dev = summary.get("device") or {}
    bw = dev.get("bandwidth") or {}
    pinned = bw.get("h2d_pinned_bytes_per_s")
    pageable = bw.get("h2d_pageable_bytes_per_s")
    link = (dev.get("pcie") or {}).get("link_bytes_per_s")
    if device_facts(trace) is None or (pinned is None and link is None):
        return None
    h2d = summary.get("h2d_bytes_per_step")
    return {
        "h2d_pinned_bytes_per_s": pinned,
        "h2d_pageable_bytes_per_s": pageable,
        "d2h_pinned_bytes_per_s": bw.get("d2h_pinned_bytes_per_s"),
        "link_bytes_per_s": link,
        "pinned_of_link": pinned / link if pinned and link else None,
        # An estimate, labelled as such in the report: the step's H2D bytes at the measured pinned rate.
        "h2d_ms_at_pinned_rate": 1000.0 * h2d / pinned if h2d is not None and pinned else None,
    }


def pcie_samples(trace: Trace) -> list[tuple[float, float, float]]:
    """``(t_ms, tx, rx)`` PCIe samples of every step that has them, in time order."""
    out: list[tuple[float, float, float]] = []
    for s in trace.steps:
        data = step_data(s)
        pcie = data.get("pcie") if data else None
        samples = pcie.get("samples") if isinstance(pcie, dict) else None
        for row in samples if isinstance(samples, list) else []:
            if isinstance(row, list) and len(row) == 3 and all(_num(v, None) is not None for v in row):
                out.append((float(row[0]), float(row[1]), float(row[2])))
    return sorted(out)


# ----------------------------------------------------------------------------------------- helpers


def _num(v: Any, default: Any = 0) -> Any:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return v if ok else default


def _text(v: Any) -> str | None:
    return str(v)[:300] if isinstance(v, str) else None


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _median_int(values: list[Any]) -> int | None:
    m = _median(values)
    return round(m) if m is not None else None
