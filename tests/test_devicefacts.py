"""Device facts: on a CPU, what is known and each missing fact named with its reason (never a zero);
NVML's answers through a fake NVML; the summary's ``device`` object and the report's Device section."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from tracebuilder import TraceBuilder, tiny_mlp

from memdoctor.capture.devicefacts import DeviceFactsCollector, gather
from memdoctor.capture.session import ProfileSession
from memdoctor.device import Device, nvml
from memdoctor.report import build_summary, render_report
from memdoctor.trace import Trace

NVML_KEYS = ("driver_version", "cuda_driver_version", "other_processes", "used_by_others_bytes", "pcie")


def test_cpu_facts_name_what_was_not_measured() -> None:
    facts = gather(Device())
    assert facts["kind"] == "cpu" and facts["torch_version"]
    for key in ("capability", "bf16_supported", "bandwidth", "free_memory_bytes", *NVML_KEYS):
        assert facts[key] is None, key  # unknown is null, never a zero
    notes = facts["not_measured"]
    assert "host<->device bandwidth: no CUDA device" in notes
    assert "compute capability: no CUDA device" in notes
    why = nvml.unavailable_reason()
    assert why in (nvml.NO_DRIVER, nvml.NO_PACKAGE)  # this machine has no NVIDIA driver
    assert f"NVIDIA driver version: {why}" in notes and f"PCIe link: {why}" in notes


def test_collector_emits_one_device_record_at_start() -> None:
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=1, warmup=0, sink=records.append, collectors=[DeviceFactsCollector()])
    session.start()
    session.stop()
    device = [r for r in records if r["type"] == "collector" and r["name"] == "device"]
    assert len(device) == 1 and device[0]["data"]["kind"] == "cpu"


class FakeNvml:
    """The few pynvml functions memdoctor calls, answering like a PCIe Gen3 RTX 2070."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 12040

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        return [
            SimpleNamespace(pid=os.getpid(), usedGpuMemory=5 << 30),
            SimpleNamespace(pid=4242, usedGpuMemory=1 << 30),
        ]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        return [SimpleNamespace(pid=77, usedGpuMemory=None)]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Any) -> int:
        return 1  # an idle link steps down

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Any) -> int:
        return 3

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Any) -> int:
        return 16

    def nvmlDeviceGetPcieThroughput(self, h: Any, counter: int) -> int:
        return 100 if counter == self.NVML_PCIE_UTIL_TX_BYTES else 2000


def test_nvml_answers_through_the_wrapper() -> None:
    dev = nvml.NvmlDevice(FakeNvml(), handle="h")
    assert dev.driver_version() == "550.54" and dev.cuda_driver_version() == "12.4"
    procs = dev.other_processes()
    assert procs == [{"pid": 77, "used_memory_bytes": None}, {"pid": 4242, "used_memory_bytes": 1 << 30}]
    link = dev.pcie_link()
    assert link is not None and (link["gen"], link["gen_max"], link["width_max"]) == (1, 3, 16)
    assert link["link_bytes_per_s"] == 16 * nvml.PCIE_LANE_BYTES_PER_S[3]  # ~15.75 GB/s for Gen3 x16
    assert link["link_bytes_per_s_current"] == 16 * 250_000_000
    assert dev.pcie_throughput() == (100 * 1024, 2000 * 1024)
    assert dev.name() is None  # a function NVML lacks answers None, not an error


def test_link_bandwidth_of_unknown_links_is_none() -> None:
    assert nvml.link_bytes_per_s(None, 16) is None
    assert nvml.link_bytes_per_s(9, 16) is None
    assert nvml.link_bytes_per_s(4, 0) is None


def test_open_device_says_why_not_here() -> None:
    dev, why = nvml.open_device(0)
    assert dev is None and why in (nvml.NO_DRIVER, nvml.NO_PACKAGE)


# ----------------------------------------------------------------------------------------- analysis

GPU_FACTS: dict[str, Any] = {
    "kind": "cuda",
    "index": 0,
    "name": "NVIDIA GeForce RTX 2070",
    "total_memory_bytes": 8 << 30,
    "free_memory_bytes": 7 << 30,
    "torch_version": "2.4.0",
    "cuda_runtime_version": "12.1",
    "cudnn_version": 90100,
    "capability": [7, 5],
    "multiprocessors": 36,
    "bf16_supported": True,
    "bf16_native": False,
    "driver_version": "550.54",
    "cuda_driver_version": "12.4",
    "other_processes": [{"pid": 4242, "used_memory_bytes": 1 << 30}],
    "used_by_others_bytes": 1 << 30,
    "pcie": {
        "gen": 3,
        "width": 16,
        "gen_max": 3,
        "width_max": 16,
        "link_bytes_per_s": 15_753_846_144,
        "link_bytes_per_s_current": 15_753_846_144,
    },
    "bandwidth": {
        "bytes": 64 << 20,
        "repeats": 3,
        "h2d_pinned_bytes_per_s": 12_000_000_000,
        "h2d_pageable_bytes_per_s": 6_000_000_000,
        "d2h_pinned_bytes_per_s": 13_000_000_000,
        "d2h_pageable_bytes_per_s": 5_000_000_000,
    },
    "not_measured": [],
}


def gpu_trace(facts: dict[str, Any] | None) -> Trace:
    b = TraceBuilder(kind="cuda")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=2)
    trace = b.end("completed").build()
    if facts is not None:
        trace.collected["device"] = facts
    return trace


def test_summary_device_is_extended_not_renamed() -> None:
    device = build_summary(gpu_trace(GPU_FACTS))["device"]
    assert device["name"] == "NVIDIA GeForce RTX 2070" and device["kind"] == "cuda"  # existing keys
    assert device["driver_version"] == "550.54" and device["cuda_driver_version"] == "12.4"
    assert device["bf16_supported"] is True and device["bf16_native"] is False
    assert device["used_by_others_bytes"] == 1 << 30
    assert device["pcie"]["gen_max"] == 3 and device["bandwidth"]["h2d_pinned_bytes_per_s"] == 12e9


def test_summary_without_a_record_keeps_the_headers_facts_only() -> None:
    device = build_summary(gpu_trace(None))["device"]
    assert device["capability"] == [7, 5] and device["bf16_native"] is False  # from the header
    assert device["driver_version"] is None and device["bandwidth"] is None and device["pcie"] is None


def test_a_crafted_record_cannot_put_garbage_in_the_summary() -> None:
    bad = {
        **GPU_FACTS,
        "capability": "9.0",
        "used_by_others_bytes": -5,
        "pcie": {"gen": "x"},
        "bf16_native": 1,
    }
    device = build_summary(gpu_trace(bad))["device"]
    assert device["capability"] is None and device["used_by_others_bytes"] is None
    assert device["pcie"]["gen"] is None and device["bf16_native"] is None


def test_report_device_section() -> None:
    facts = {**GPU_FACTS, "not_measured": ["PCIe link: <b>NVML</b> did not answer"]}
    html = render_report(gpu_trace(facts))
    assert 'id="device-facts-table"' in html and 'id="device-bandwidth"' in html
    assert "emulated only" in html and "Gen3 x16" in html
    assert "&lt;b&gt;NVML&lt;/b&gt;" in html and "<b>NVML</b>" not in html  # escaped


@pytest.mark.parametrize("note", [None, "device: pynvml not installed (pip install memdoctor[gpu])"])
def test_report_without_a_record_says_not_measured(note: str | None) -> None:
    trace = gpu_trace(None)
    if note:
        trace.header["not_measured"] = [note]
    html = render_report(trace)
    expected = "pynvml not installed" if note else "this trace has no device record"
    assert f"Not measured: {expected}" in html
