"""The report's "Device" section: the card's facts table, the other processes on it, the measured
copy bandwidth against the link's, and what could not be measured."""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.devicefacts import bandwidth_rows, record_fields
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """Facts table rows and the not-measured notes; None when the trace has no device record."""
    rec = record_fields(trace)
    if rec is None:
        return None
    dev = summary.get("device") or {}
    return {
        "rows": _rows(rec, dev),
        "processes": rec["processes"],
        "bandwidth": bandwidth_rows(dev.get("bandwidth"), (dev.get("pcie") or {}).get("link_bytes_per_s")),
        "not_measured": rec["not_measured"],
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
        ("name", rec["name"], "text"),
        ("total memory", rec["total_memory_bytes"], "bytes"),
        ("free at start", dev.get("free_memory_bytes"), "bytes"),
        ("used by other processes", dev.get("used_by_others_bytes"), "bytes"),
        ("compute capability", ".".join(str(c) for c in cap) if cap else None, "text"),
        ("bf16", _bf16_text(dev.get("bf16_supported"), dev.get("bf16_native")), "text"),
        ("NVIDIA driver", dev.get("driver_version"), "text"),
        ("CUDA (driver supports / torch built with)", _pair(dev), "text"),
        ("cuDNN", rec["cudnn_version"], "text"),
        ("torch", rec["torch_version"], "text"),
        ("PCIe link", link, "text"),
        ("PCIe link bandwidth (max, each way)", pcie.get("link_bytes_per_s"), "rate"),
    ]
    return [
        {"label": label, "value": value, "unit": unit} for label, value, unit in rows if value is not None
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
