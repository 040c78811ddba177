"""The "Device" section: what card the run had, read from the trace's ``device`` collector record.

``summarize`` extends ``summary.json``'s ``device`` object (its existing keys are left as they are);
``report_section`` gives the facts table and the list of what could not be measured. A trace without
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
        }
    )
    if device["bf16_native"] is None and device["capability"] is not None:
        device["bf16_native"] = device["capability"] >= [8, 0]


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """Facts table rows and the not-measured notes; None when the trace has no device record."""
    rec = facts(trace)
    if rec is None:
        return None
    dev = summary.get("device") or {}
    return {
        "rows": _rows(rec, dev),
        "processes": _processes(rec.get("other_processes")),
        "bandwidth": _bandwidth_rows(dev.get("bandwidth"), (dev.get("pcie") or {}).get("link_bytes_per_s")),
        "not_measured": [str(n) for n in rec.get("not_measured") or [] if isinstance(n, str)],
    }


def _rows(rec: dict[str, Any], dev: dict[str, Any]) -> list[dict[str, Any]]:
    """``{label, value, unit}`` rows (``unit``: ``bytes``, ``rate`` or ``text``); unknown ones left out."""
    pcie = dev.get("pcie") or {}
    link = None
    if pcie.get("gen") is not None:
        link = (
            f"Gen{pcie['gen']} x{pcie.get('width')} (max Gen{pcie.get('gen_max')} x{pcie.get('width_max')})"
        )
    cap = dev.get("capability")
    rows = [
        ("name", _text(rec.get("name")), "text"),
        ("total memory", _count(rec.get("total_memory_bytes")), "bytes"),
        ("free at start", dev.get("free_memory_bytes"), "bytes"),
        ("used by other processes", dev.get("used_by_others_bytes"), "bytes"),
        ("compute capability", ".".join(str(c) for c in cap) if cap else None, "text"),
        ("bf16", _bf16_text(dev.get("bf16_supported"), dev.get("bf16_native")), "text"),
        ("NVIDIA driver", dev.get("driver_version"), "text"),
        ("CUDA (driver supports / torch built with)", _pair(dev), "text"),
        ("cuDNN", _text(rec.get("cudnn_version")), "text"),
        ("torch", _text(rec.get("torch_version")), "text"),
        ("PCIe link", link, "text"),
        ("PCIe link bandwidth (max, each way)", pcie.get("link_bytes_per_s"), "rate"),
    ]
    return [
        {"label": label, "value": value, "unit": unit} for label, value, unit in rows if value is not None
    ]


def _bandwidth_rows(bw: dict[str, Any] | None, link: Any) -> list[dict[str, Any]]:
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


def _bf16_text(supported: bool | None, native: bool | None) -> str | None:
    if supported is None and native is None:
        return None
    if native:
        return "native (compute capability 8.0 or later)"
    if supported:
        return "emulated only (torch accepts bf16, but this GPU has no native bf16: slow)"
    return "not supported"


def _pair(dev: dict[str, Any]) -> str | None:
    a, b = dev.get("cuda_driver_version"), dev.get("cuda_runtime_version")
    return None if a is None and b is None else f"{a or 'unknown'} / {b or 'unknown'}"


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
