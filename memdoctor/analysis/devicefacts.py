"""The "Device" section: what card the run had, read from the trace's ``device`` collector record.

``summarize`` extends ``summary.json``'s ``device`` object (its existing keys are left as they are);
``record_fields`` and ``bandwidth_rows`` are the rest of what the report's section shows. A trace without
the record (an older memdoctor, ``--collect`` without ``device``) keeps what its header says:
torch's capability and bf16 answer, nothing invented.
"""

from __future__ import annotations

import math
from typing import Any

from memdoctor.trace import Trace

RECORD = "device"
BANDWIDTH_KEYS = (
    "h2d_pinned_bytes_per_s",
    "h2d_pageable_bytes_per_s",
    "d2h_pinned_bytes_per_s",
    "d2h_pageable_bytes_per_s",
)
HOST_OPTIMIZER_KEYS = ("bytes_per_s", "bytes", "repeats", "threads")
PCIE_KEYS = ("gen", "width", "gen_max", "width_max", "link_bytes_per_s", "link_bytes_per_s_current")


def facts(trace: Trace) -> dict[str, Any] | None:
    """The ``device`` record's data, or None when the trace has none."""
    data = trace.collected.get(RECORD)
    return data if isinstance(data, dict) else None


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """Add the device facts to ``summary["device"]``: null where not measured."""
    rec = facts(trace) or {}
    header = trace.device
    device = summary.setdefault("device", {})
    device.update(
        {
            "driver_version": _text(rec.get("driver_version")),
            "cuda_driver_version": _text(rec.get("cuda_driver_version")),
            "cuda_runtime_version": _text(rec.get("cuda_runtime_version", header.get("torch_cuda"))),
            "capability": _capability(rec.get("capability", header.get("capability"))),
            "bf16_supported": _flag(rec.get("bf16_supported", header.get("bf16_supported"))),
            "bf16_native": _flag(rec.get("bf16_native")),
            "free_memory_bytes": _count(rec.get("free_memory_bytes")),
            "used_by_others_bytes": _count(rec.get("used_by_others_bytes")),
            "pcie": _numbers(rec.get("pcie"), PCIE_KEYS),
            "bandwidth": _numbers(rec.get("bandwidth"), (*BANDWIDTH_KEYS, "bytes", "repeats")),
            "host_optimizer": _numbers(rec.get("host_optimizer"), HOST_OPTIMIZER_KEYS),
        }
    )
    if device["bf16_native"] is None and device["capability"] is not None:
        device["bf16_native"] = device["capability"] >= [8, 0]


def record_fields(trace: Trace) -> dict[str, Any] | None:
    """The record's facts that ``summary.json`` leaves out (the name and total memory as the record
    says them, cuDNN, torch, the other processes, what it could not measure), each checked; None when
    the trace has no device record."""
    rec = facts(trace)
    if rec is None:
        return None
    return {
        "name": _text(rec.get("name")),
        "total_memory_bytes": _count(rec.get("total_memory_bytes")),
        "cudnn_version": _text(rec.get("cudnn_version")),
        "torch_version": _text(rec.get("torch_version")),
        "processes": _processes(rec.get("other_processes")),
        "not_measured": [str(n) for n in rec.get("not_measured") or [] if isinstance(n, str)],
    }


def bandwidth_rows(bw: dict[str, Any] | None, link: Any) -> list[dict[str, Any]]:
    """The measured copy rates, one row per direction and host memory kind, each as a share of the
    link's rate where that is known."""
    if not bw:
        return []
    out = []
    for key in BANDWIDTH_KEYS:
        rate = bw.get(key)
        if rate is None:
            continue
        direction, host = key.split("_")[:2]
        out.append(
            {
                "direction": "host to device" if direction == "h2d" else "device to host",
                "host": host,
                "bytes_per_s": rate,
                "of_link": rate / link if link else None,
            }
        )
    return out


def _processes(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list):
        return None
    return [
        {"pid": _count(p.get("pid")), "used_memory_bytes": _count(p.get("used_memory_bytes"))}
        for p in value
        if isinstance(p, dict)
    ]


# A trace is untrusted input: every value is checked before the report uses it.
def _text(v: Any) -> str | None:
    return str(v)[:200] if isinstance(v, (str, int)) and not isinstance(v, bool) else None


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _capability(v: Any) -> list[int] | None:
    ok = isinstance(v, list) and len(v) == 2 and all(_count(x) is not None for x in v)
    return [int(x) for x in v] if ok else None


def _numbers(v: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The numeric fields ``keys`` of an object (null where missing or invalid), or None."""
    if not isinstance(v, dict):
        return None
    return {k: _finite(v.get(k)) for k in keys}


def _finite(v: Any) -> int | float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return v if ok else None
