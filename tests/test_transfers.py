"""Host<->device transfers on a CPU: the ``meta`` device stands in for the GPU, so ``x.to("meta")`` of a
known tensor is a host-to-device copy of exactly its bytes; with the CPU as "the accelerator", a CPU
tensor's ``.item()`` is a synchronising device-to-host read."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from tracebuilder import TraceBuilder, tiny_mlp

from memdoctor.capture import transferwraps
from memdoctor.capture.collectors import CollectorUnavailable
from memdoctor.capture.session import ProfileSession
from memdoctor.capture.transfers import COPY_CAP, TransferCollector
from memdoctor.device import Device
from memdoctor.report import build_summary, render_report
from memdoctor.trace import StepRecord, load_trace

DATA = Path(__file__).parent / "data"
PINNED = "_test_pinned"


def fake_pinned(t: torch.Tensor) -> bool:
    return bool(getattr(t, PINNED, False))


def collector(accelerator: str = "meta", **kw: Any) -> TransferCollector:
    return TransferCollector(Device(), accelerator=accelerator, is_pinned=fake_pinned, **kw)


class Upload(nn.Module):
    """Copies a pinned 1024-float buffer to the fake GPU, non-blocking, inside its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(1024)
        setattr(buf, PINNED, True)
        buf.to("meta", non_blocking=True)
        x.to(torch.float64)  # a dtype cast: no transfer
        return x


def train(col: TransferCollector, steps: int = 3, body: Any = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    torch.manual_seed(0)
    model = nn.Sequential(Upload(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ProfileSession(steps=steps - 1, warmup=1, sink=records.append, collectors=[col]):
        for _ in range(steps):
            x = torch.randn(4, 8)
            x.to("meta")  # 128 bytes, pageable, synchronous, between steps ("other")
            if body is not None:
                body()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return records


def final_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["type"] == "step":
            out[r["step"]] = r  # the last record of a step wins, as when the trace is read
    return out


def snapshot() -> tuple[dict[str, Any], Any, Any]:
    return dict(vars(torch.Tensor)), torch.tensor, torch.as_tensor


def test_h2d_copy_of_known_size_with_flags_module_and_phase() -> None:
    steps = final_steps(train(collector()))
    data = steps[1]["collectors"]["transfers"]
    assert data["h2d"]["bytes"] == 4096 + 128 and data["h2d"]["copies"] == 2
    assert data["h2d"]["pageable_bytes"] == 128 and data["h2d"]["sync"] == 1
    assert data["d2h"]["bytes"] == 0 and data["sync_reads"] == 0
    loader, upload = data["copies"]
    assert loader["bytes"] == 128 and loader["phase"] == "other" and loader["module"] is None
    assert loader["pinned"] is False and loader["non_blocking"] is False and loader["host_ms"] >= 0
    line = _line_of('x.to("meta")  #')
    assert loader["site"] == f"tests/test_transfers.py:{line}"
    assert upload["bytes"] == 4096 and upload["pinned"] is True and upload["non_blocking"] is True
    assert upload["phase"] == "forward" and (upload["model"], upload["module"]) == (0, 1)
    assert upload["host_ms"] is None and upload["device_ms"] is not None  # async: device markers
    assert data["more"] == {"count": 0, "groups": []}
    # it reads back from a trace record
    assert StepRecord.from_record(steps[1]).collectors["transfers"]["h2d"]["bytes"] == 4224


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith(text))


def test_item_and_float_are_sync_reads() -> None:
    col = collector(accelerator="cpu")
    loss = torch.tensor(2.5)
    steps = final_steps(train(col, body=lambda: (loss.item(), float(loss), loss.numpy())))
    data = steps[1]["collectors"]["transfers"]
    reads = [c for c in data["copies"] if c["dir"] == "d2h"]
    assert [c["op"] for c in reads] == ["item", "float"]  # .numpy() without force= copies nothing
    assert data["sync_reads"] == 2 and data["d2h"]["bytes"] == 2 * loss.element_size()
    assert all(c["sync"] and c["phase"] == "other" for c in reads)


def test_memdoctors_own_reads_are_not_counted() -> None:
    """With the CPU as the accelerator, the session's gradient norms (read with .tolist()) would count
    as the script's reads if memdoctor's own calls were not left out."""
    steps = final_steps(train(collector(accelerator="cpu")))
    assert all(s["collectors"]["transfers"]["sync_reads"] == 0 for s in steps.values() if "collectors" in s)


def test_patches_are_restored_after_stop_and_after_an_exception() -> None:
    before = snapshot()
    col = collector()

    def boom() -> None:
        assert vars(torch.Tensor)["to"] is not before[0].get("to")  # installed while running
        raise RuntimeError("the script failed")

    with pytest.raises(RuntimeError, match="the script failed"):
        train(col, body=boom)
    assert snapshot() == before
    assert "to" not in vars(torch.Tensor) and torch.Tensor.to is torch._C.TensorBase.to
    col.stop()  # twice is safe
    assert snapshot() == before


def test_a_wrapper_someone_installed_on_top_stays_and_ours_passes_through() -> None:
    before = snapshot()
    col = collector()
    session = ProfileSession(steps=1, warmup=0, collectors=[col])
    session.start()
    ours = torch.Tensor.to
    calls: list[int] = []

    def theirs(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        calls.append(1)
        return ours(self, *a, **k)

    torch.Tensor.to = theirs  # type: ignore[method-assign]
    try:
        session.stop()
        assert torch.Tensor.to is theirs
        torch.zeros(2).to("meta")
        assert calls == [1] and col.logs.get(0) is None  # ours passed the call through unrecorded
    finally:
        del torch.Tensor.to
    assert snapshot() == before


def test_copies_beyond_the_cap_are_aggregated() -> None:
    col = collector()
    steps = final_steps(train(col, body=lambda: [torch.ones(2).to("meta") for _ in range(COPY_CAP + 40)]))
    data = steps[1]["collectors"]["transfers"]
    assert len(data["copies"]) == COPY_CAP
    assert data["more"]["count"] == 42  # 40 + the loader copy and the Upload copy
    assert data["h2d"]["copies"] == COPY_CAP + 42
    assert data["h2d"]["bytes"] == (COPY_CAP + 40) * 8 + 128 + 4096
    assert sum(g["count"] for g in data["more"]["groups"]) == 42


def test_torch_tensor_with_a_device_is_an_h2d_copy() -> None:
    steps = final_steps(train(collector(), body=lambda: torch.tensor([1.0, 2.0, 3.0], device="meta")))
    made = [c for c in steps[1]["collectors"]["transfers"]["copies"] if c["op"] == "tensor"]
    assert len(made) == 1 and made[0]["bytes"] == 12 and made[0]["dir"] == "h2d"


def test_pcie_sampler_runs_during_the_steps_and_is_joined_on_stop() -> None:
    col = collector(pcie_reader=lambda: (1000, 2000), sample_interval_s=0.005)
    records = train(col, body=lambda: threading.Event().wait(0.03))
    assert col.sampler is not None and not col.sampler.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "memdoctor-pcie"]
    pcie = final_steps(records)[1]["collectors"]["transfers"]["pcie"]
    assert pcie["count"] >= 1 and pcie["tx_mean_bytes_per_s"] == 1000 and pcie["rx_max_bytes_per_s"] == 2000
    run_wide = next(r for r in records if r["type"] == "collector" and r["name"] == "transfers")
    assert run_wide["data"]["not_measured"] == [] and run_wide["data"]["pcie_interval_s"] == 0.005


def test_a_failing_pcie_reader_stops_the_sampler_and_not_the_script() -> None:
    def broken() -> tuple[int, int]:
        raise OSError("gone")

    col = collector(pcie_reader=broken, sample_interval_s=0.001)
    records = train(col, body=lambda: threading.Event().wait(0.01))
    assert not col.sampler.is_alive()  # type: ignore[union-attr]
    assert final_steps(records)[1]["collectors"]["transfers"]["pcie"] is None


def test_without_nvml_the_pcie_counters_are_not_measured() -> None:
    records = train(collector())
    run_wide = next(r for r in records if r["type"] == "collector" and r["name"] == "transfers")
    assert run_wide["data"]["not_measured"] == ["PCIe throughput counters: no CUDA device"]


def test_unavailable_without_a_cuda_device() -> None:
    with pytest.raises(CollectorUnavailable, match="no CUDA device"):
        TransferCollector(Device())


def test_helpers_parse_to_arguments() -> None:
    meta = torch.zeros(1, device="meta")
    assert transferwraps._target(("cuda:1",), {}, "cuda") == "cuda"
    assert transferwraps._target((torch.float16,), {}, "cuda") is None
    assert transferwraps._target((), {"device": torch.device("cpu")}, "cuda") == "cpu"
    assert transferwraps._target((meta,), {}, "cuda") == "meta"
    assert transferwraps._target((0,), {}, "cuda") == "cuda"
    assert transferwraps._flag(("cuda", torch.float16, True), {}, "non_blocking") is True
    assert transferwraps._flag(("cuda",), {"non_blocking": False}, "non_blocking") is False


# ----------------------------------------------------------------------------------------- analysis


def traced(tmp_path: Path) -> Any:
    """A CPU trace whose steps carry what the collector recorded on a real (tiny) run."""
    recorded = final_steps(train(collector(), steps=4, body=lambda: torch.tensor(1.0).to("meta")))
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=3)
    b.end("completed")
    trace = b.build()
    for s in trace.steps:
        s.collectors = recorded[s.step]["collectors"]
        data = s.collectors["transfers"]  # and a loss.item() in module 1, as a GPU run records it
        data["copies"].append({**READ, "model": 0, "module": 1})
        data["d2h"].update(bytes=4, copies=1, sync=1, pageable_bytes=4, host_ms=0.5)
        data["sync_reads"] = 1
    return trace


READ = {
    "op": "item",
    "dir": "d2h",
    "bytes": 4,
    "pinned": False,
    "non_blocking": False,
    "sync": True,
    "phase": "forward",
    "site": "project/train.py:42",
    "host_ms": 0.5,
    "device_ms": None,
}


def test_summary_medians_and_where(tmp_path: Path) -> None:
    trace = traced(tmp_path)
    summary = build_summary(trace)
    assert summary["h2d_bytes_per_step"] == 4096 + 128 + 4 and summary["d2h_bytes_per_step"] == 4
    x = summary["transfers"]
    assert [r["step"] for r in x["steps"]] == [1, 2, 3]
    assert x["pageable_share"] == pytest.approx((132 + 4) / (4228 + 4))
    biggest = x["biggest"][0]
    assert biggest["bytes_per_step"] == 4096 and biggest["pinned"] and biggest["phase"] == "forward"
    assert biggest["site"].startswith("tests/test_transfers.py:") and biggest["per_step"] == 1
    assert x["sync_reads_per_step"] == 1 and x["host_ms_per_step"] >= 0.5
    (read,) = x["sync_reads"]
    assert read["op"] == "item" and read["site"] == "project/train.py:42" and read["per_step"] == 1
    assert read["module"] == trace.models[0].names[1] and read["host_ms_per_step"] == 0.5


def test_report_renders_the_transfers_section(tmp_path: Path) -> None:
    html = render_report(traced(tmp_path))
    assert 'id="transfer-steps"' in html and 'id="transfer-biggest"' in html
    assert 'id="transfer-sync-reads"' in html and "project/train.py:42" in html


def test_summary_is_null_without_transfer_data() -> None:
    b = TraceBuilder(kind="cpu", not_measured=["transfers: no CUDA device: there are no host-device copies"])
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=2)
    trace = b.end("completed").build()
    summary = build_summary(trace)
    assert summary["h2d_bytes_per_step"] is None and summary["transfers"] is None
    html = render_report(trace, summary)
    assert "Not measured: no CUDA device: there are no host-device copies." in html


def test_recorded_gpu_traces_count_the_batch_copies() -> None:
    # On the H200: each BERT step copies input_ids and attention_mask (32 x 512 int64) and the labels
    # (32 int64) to the GPU; each GPT-2 Trainer step input_ids, attention_mask, labels (8 x 512 int64).
    bert = build_summary(load_trace(DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"))
    assert bert["h2d_bytes_per_step"] == 2 * 32 * 512 * 8 + 32 * 8
    gpt2 = build_summary(load_trace(DATA / "gpu-gpt2-small-trainer-b8-s512.jsonl.gz"))
    assert gpt2["h2d_bytes_per_step"] == 3 * 8 * 512 * 8
    dev = bert["device"]
    assert dev["pcie"]["gen"] == 5 and dev["pcie"]["width"] == 16
    bw = dev["bandwidth"]
    assert bw["h2d_pinned_bytes_per_s"] > bw["h2d_pageable_bytes_per_s"] > 0


@pytest.mark.parametrize(
    "path", [DATA / "pre-collectors-bert-base-b8-s128-8gib.jsonl.gz"], ids=lambda p: p.name
)
def test_recorded_gpu_traces_say_not_measured(path: Path) -> None:
    trace = load_trace(path)
    summary = build_summary(trace)
    assert summary["h2d_bytes_per_step"] is None and summary["transfers"] is None
    html = render_report(trace, summary)
    assert '<h2 id="transfers">' in html and '<h2 id="device-facts">' in html
    assert "Not measured: this trace has no transfer data" in html
    assert "Not measured: this trace has no device record" in html


def test_compiled_code_traces_through_the_wrappers_without_a_graph_break() -> None:
    col = collector()
    session = ProfileSession(steps=1, warmup=0, collectors=[col])
    session.start()
    try:
        compiled = torch.compile(
            lambda x: (x.to(torch.float64) * 2).to(torch.float32), backend="eager", fullgraph=True
        )
        assert compiled(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        torch.ones(2).to("meta")  # outside compiled code: still recorded
    finally:
        session.stop()
    assert [c[:3] for c in col.logs[0].copies] == [("to", "h2d", 8)]
