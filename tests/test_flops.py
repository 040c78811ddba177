"""The flops collector and the compute section: FLOPs that match torch's counter, per-module attribution
forward and backward, one measured (and marked) step, a dispatch mode that never outlives the session,
and reports that say "not measured" for traces without a FLOP count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode
from tracebuilder import TraceBuilder, tiny_mlp

from memdoctor.capture.flops import FlopCollector, measured_step
from memdoctor.capture.session import ProfileSession
from memdoctor.cards import device_peaks
from memdoctor.report import build_summary, render_report
from memdoctor.report.sections import compute as compute_section
from memdoctor.trace import StepRecord, Trace, load_trace

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]
B, IN, OUT = 4, 8, 16


class Head(nn.Module):
    """One Linear, on an input that requires a gradient: backward computes the weight's and the input's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class SharedInput(nn.Module):
    """Three Linears of different widths on one input, like query/key/value: their backward passes all
    end together, when the shared input's gradient is complete."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(OUT, 4), nn.Linear(OUT, 8), nn.Linear(OUT, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def profile(
    model: nn.Module, *, steps: int = 2, warmup: int = 1, fail_at: int | None = None
) -> tuple[list[dict[str, Any]], FlopCollector]:
    records: list[dict[str, Any]] = []
    collector = FlopCollector()
    session = ProfileSession(steps=steps, warmup=warmup, sink=records.append, collectors=[collector])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    with session:
        for i in range(steps + warmup + 1):
            x = torch.randn(B, IN, requires_grad=True)
            out = model(x)
            if i == fail_at:
                raise RuntimeError("planted failure")
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    return records, collector


def steps_of(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if r["type"] == "step"}  # the last record of a step wins


def column(record: dict[str, Any], name: str) -> list[Any]:
    return record["modules"]["0"][name]


def test_linear_forward_is_2BIO_and_backward_twice_that_as_torch_counts() -> None:
    records, _ = profile(Head())
    data = steps_of(records)[0]["collectors"]["flops"]
    forward = 2 * B * IN * OUT
    assert data["flops"]["forward"] == forward
    assert data["flops"]["backward"] == 2 * forward  # the weight's gradient and the input's
    assert data["flops"]["optimizer"] == 0  # SGD is elementwise: torch's counter counts it as zero
    assert data["flops"]["total"] == 3 * forward
    # the same figure as torch's own counter on the same computation
    with FlopCounterMode(display=False) as counter:
        Head()(torch.randn(B, IN, requires_grad=True)).pow(2).mean().backward()
    assert counter.get_total_flops() == data["flops"]["total"]
    # bytes: at least the Linear's input, weight, bias and output once each, forward
    assert data["bytes"]["forward"] >= 4 * (B * IN + IN * OUT + OUT + B * OUT)
    assert data["flops_by_dtype"] == {"float32": 3 * forward}
    assert data["unattributed_flops"] == 0


def test_flops_land_on_the_module_that_ran_them_forward_and_backward() -> None:
    records, _ = profile(nn.Sequential(Head(), nn.ReLU(), SharedInput()))
    rec = steps_of(records)[0]
    names = next(r for r in records if r["type"] == "model")["modules"]["name"]
    flops, backward = column(rec, "flops"), column(rec, "flops_backward")
    at = {n: (flops[i], backward[i]) for i, n in enumerate(names)}
    head = 2 * B * IN * OUT
    assert at["0.lin"] == (3 * head, 2 * head)
    assert at["0"] == at["0.lin"]  # inclusive of submodules
    assert at["1"] == (0, 0)  # ReLU: elementwise
    for name, width in (("2.q", 4), ("2.k", 8), ("2.v", 12)):  # each its own, not its siblings'
        assert at[name] == (3 * 2 * B * OUT * width, 2 * 2 * B * OUT * width), name
    shared = sum(3 * 2 * B * OUT * w for w in (4, 8, 12))
    assert at["2"][0] == shared
    assert at[""][0] == 3 * head + shared == rec["collectors"]["flops"]["flops"]["total"]
    byte_col = column(rec, "flop_bytes")
    assert all(b > 0 for b in byte_col) and byte_col[0] >= max(byte_col[1:])


class Checkpointed(nn.Module):
    """A two-Linear block under activation checkpointing, then a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(IN, IN), nn.ReLU(), nn.Linear(IN, IN))
        self.head = nn.Linear(IN, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.blk, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_counts_as_backward_of_the_recomputed_module(reentrant: bool) -> None:
    records, _ = profile(Checkpointed(reentrant))
    rec = steps_of(records)[0]
    names = next(r for r in records if r["type"] == "model")["modules"]["name"]
    at = dict(zip(names, zip(column(rec, "flops"), column(rec, "flops_backward"), strict=True), strict=True))
    total = rec["collectors"]["flops"]["flops"]
    lin = 2 * B * IN * IN
    # the first Linear is recomputed in backward (both modes); a non-reentrant checkpoint stops
    # recomputing once every saved tensor is back, before the last Linear's matmul
    assert at["blk.0"] == (lin + 2 * lin + lin, 2 * lin + lin)
    assert at["blk.2"] == ((4 if reentrant else 3) * lin, (3 if reentrant else 2) * lin)
    assert at[""][0] == total["total"] and rec["collectors"]["flops"]["unattributed_flops"] == 0
    assert total["forward"] == 2 * lin + 2 * B * IN * 2


@pytest.mark.parametrize(("warmup", "expected"), [(0, 0), (1, 0), (2, 1)])
def test_one_step_is_measured_and_marked(warmup: int, expected: int) -> None:
    assert measured_step(warmup) == expected
    records, _ = profile(Head(), steps=2, warmup=warmup)
    counted = {s: r for s, r in steps_of(records).items() if "flops" in (r.get("collectors") or {})}
    assert list(counted) == [expected]
    assert counted[expected]["collectors"]["flops"]["perturbed"] is True
    assert counted[expected]["collectors"]["flops"]["complete"] is True
    others = [r for s, r in steps_of(records).items() if s != expected]
    assert others and all("flops" not in r["modules"]["0"] for r in others)
    planned = [r for r in records if r["type"] == "collector" and r["name"] == "flops"]
    assert planned and planned[-1]["data"]["measured_step"] == expected
    assert _get_current_dispatch_mode() is None


def test_the_mode_is_left_when_the_script_raises_in_the_measured_step() -> None:
    with pytest.raises(RuntimeError, match="planted failure"):
        profile(Head(), warmup=1, fail_at=0)
    assert _get_current_dispatch_mode() is None


def test_the_mode_is_left_when_the_session_stops_mid_step() -> None:
    records: list[dict[str, Any]] = []
    collector = FlopCollector()
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[collector])
    model = Head()
    session.start()
    try:
        model(torch.randn(B, IN))
        assert isinstance(_get_current_dispatch_mode(), torch.utils._python_dispatch.TorchDispatchMode)
    finally:
        session.stop()
    assert _get_current_dispatch_mode() is None
    session.stop()  # twice is safe
    assert collector.step_field(0)["complete"] is False
    model(torch.randn(B, IN)).sum().backward()  # torch runs on without the mode


def test_a_counting_failure_stops_counting_but_never_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    from memdoctor.capture import flopcount

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("counting bug")

    monkeypatch.setattr(flopcount.CountingMode, "_count", broken)
    records, _ = profile(Head(), steps=2, warmup=1)
    data = steps_of(records)[0]["collectors"]["flops"]
    assert data["complete"] is False and "counting bug" in data["error"]
    assert len(steps_of(records)) == 3 and _get_current_dispatch_mode() is None


def test_steps_other_than_the_measured_one_run_without_the_mode() -> None:
    seen: list[Any] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_get_current_dispatch_mode())
            return x

    profile(nn.Sequential(Probe(), Head()), steps=3, warmup=1)
    assert len(seen) >= 4 and seen[0] is not None and all(m is None for m in seen[1:])


# ----------------------------------------------------------------------------------------- analysis


def flop_trace(device: str | None, *, intensity: float = 10.0, warmup: int = 1, profiled: int = 3) -> Trace:
    """A synthetic trace whose measured step (the last warm-up step) carries a FLOP count."""
    b = TraceBuilder(kind="cuda" if device else "cpu", device_name=device)
    b.add_model(tiny_mlp(width=64, depth=2))
    b.add_steps(warmup=warmup, profiled=profiled)
    step = b.steps[measured_step(warmup)]
    fwd, nbytes = 1_000_000, int(3_000_000 / intensity)
    step.collectors["flops"] = {
        "step": step.step,
        "perturbed": True,
        "complete": True,
        "counter": "torch.utils.flop_counter",
        "flops": {"forward": fwd, "backward": 2 * fwd, "optimizer": 0, "other": 0, "total": 3 * fwd},
        "bytes": {"forward": nbytes // 2, "backward": nbytes - nbytes // 2, "optimizer": 99, "other": 0},
        "flops_by_dtype": {"bfloat16": 3 * fwd - 10, "float32": 10},
        "top_ops": [{"op": "aten.mm", "flops": 3 * fwd, "bytes": nbytes, "calls": 6}],
    }
    # modules: root, 0 (Linear), 1 (ReLU), 2 (Linear), 3 (ReLU)
    step.modules[0]["flops"] = [3 * fwd, fwd, 0, 2 * fwd, 0]
    step.modules[0]["flop_bytes"] = [nbytes, nbytes // 4, nbytes // 4, nbytes // 4, nbytes // 4]
    return b.end("completed").build()


@pytest.mark.parametrize(("intensity", "expected"), [(10.0, "low"), (100.0, "medium"), (300.0, "high")])
def test_class_against_the_h200_ridge_point(intensity: float, expected: str) -> None:
    summary = build_summary(flop_trace("NVIDIA H200", intensity=intensity))
    c = summary["compute"]
    assert summary["flops_per_step"] == 3_000_000
    assert c["arithmetic_intensity"] == pytest.approx(intensity, rel=1e-3)
    assert c["roofline"]["dtype"] == "bfloat16"  # the dtype of most FLOPs picks the peak
    assert c["roofline"]["ridge_point"] == pytest.approx(989e12 / 4.8e12)
    assert c["class"] == expected and "ridge point" in c["evidence"]


def test_achieved_flops_leave_the_perturbed_step_out() -> None:
    trace = flop_trace("NVIDIA H200", warmup=0, profiled=3)
    summary = build_summary(trace)
    c = summary["compute"]
    others = [s.duration_ms for s in trace.profiled_steps() if s.step != 0]
    assert c["measured_step"] == 0 and c["step_time_ms"] == pytest.approx(sorted(others)[len(others) // 2])
    assert c["achieved_flops_per_s"] == pytest.approx(3_000_000 / (c["step_time_ms"] / 1e3))
    assert c["peak_fraction"] == pytest.approx(c["achieved_flops_per_s"] / 989e12)
    only = build_summary(flop_trace("NVIDIA H200", warmup=0, profiled=1))["compute"]
    assert only["step_time_ms"] is None and only["achieved_flops_per_s"] is None


def test_unknown_device_has_no_class_and_says_why() -> None:
    for device in (None, "Some Future GPU 9000"):
        c = build_summary(flop_trace(device))["compute"]
        assert c["class"] is None and c["roofline"] is None
        assert "unknown device" in c["evidence"]


def test_layers_carry_flops_and_intensity() -> None:
    summary = build_summary(flop_trace("NVIDIA H200"))
    rows = {r["name"]: r for r in summary["layers"]}
    assert rows["0"]["flops"] == 1_000_000 and rows["2"]["flops"] == 2_000_000
    assert rows["0"]["arithmetic_intensity"] == pytest.approx(1_000_000 / (300_000 // 4))
    assert rows["1"]["arithmetic_intensity"] == 0.0
    ctx = compute_section.report_section(flop_trace("NVIDIA H200"), summary)
    assert ctx["measured"] and [m["name"] for m in ctx["modules"]] == ["2", "0"]
    assert ctx["chart"].startswith("data:image/svg+xml;base64,")


def test_device_table_matches_specific_names_first() -> None:
    assert device_peaks("NVIDIA H100 PCIe")[0] == "H100 PCIe"  # type: ignore[index]
    assert device_peaks("NVIDIA H100 80GB HBM3")[0] == "H100"  # type: ignore[index]
    assert device_peaks("NVIDIA L40S")[0] == "L40S"  # type: ignore[index]
    assert device_peaks("NVIDIA GeForce RTX 2070")[1].get("bfloat16") is None  # type: ignore[index]
    assert device_peaks("cpu") is None


def test_recorded_gpu_trace_counts_bert_base_flops() -> None:
    # BERT-base, batch 32 x 512 tokens, recorded on the H200: forward ~ 2 x 85M (encoder + pooler
    # weights) x 16384 tokens + attention 4 x 12 layers x 512^2 x 768 x 32; backward ~ 2x forward.
    trace = load_trace(DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz")
    summary = build_summary(trace)
    tokens, layers = 32 * 512, 12
    forward = 2 * 85e6 * tokens + 4 * layers * 512 * 512 * 768 * 32
    assert summary["flops_per_step"] == pytest.approx(3 * forward, rel=0.15)
    assert summary["compute"]["class"] == "high" and summary["compute"]["roofline"]["device"] == "H200"
    encoder = next(r for r in summary["layers"] if r["name"] == "bert.encoder")
    assert encoder["flops"] > 0.9 * summary["compute"]["flops"]["forward"] * 2


@pytest.mark.parametrize(
    "path", [DATA / "pre-collectors-bert-base-b8-s128-8gib.jsonl.gz"], ids=lambda p: p.name
)
def test_traces_from_before_collectors_say_not_measured(path: Path) -> None:
    trace = load_trace(path)
    summary = build_summary(trace)
    assert summary["flops_per_step"] is None and summary["compute"] is None
    assert summary["layers"] and all(r["flops"] is None for r in summary["layers"])
    assert all(r["arithmetic_intensity"] is None for r in summary["layers"])
    ctx = compute_section.report_section(trace, summary)
    assert ctx["measured"] is False and "no FLOP count" in ctx["reason"]
    html = render_report(trace)
    section = html[html.index('id="compute"') :]
    assert section[: section.index("<h2")].count("Not measured:") == 1


def test_incomplete_measured_step_has_no_flops_per_step() -> None:
    trace = flop_trace("NVIDIA H200")
    step: StepRecord = trace.steps[0]
    step.collectors["flops"]["complete"] = False
    summary = build_summary(trace)
    assert summary["flops_per_step"] is None and summary["compute"]["complete"] is False


# ----------------------------------------------------------------------------------------- end to end


SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if step == FAIL:
        raise RuntimeError("planted failure")
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("fail", [None, 0])
def test_profile_cli_counts_or_says_why(tmp_path: Path, fail: int | None) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("FAIL", repr(fail)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--steps", "2", "--warmup", "1"]
    cmd += ["--collect", "flops", "-o", str(out), str(script)]
    subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=_env())
    summary = json.loads((out / "summary.json").read_text())
    if fail is None:
        # first Linear: forward 2*4*8*16 and its weight gradient (its input needs none); second: 3x 2*4*16*2
        assert summary["flops_per_step"] == 2 * (2 * 4 * 8 * 16) + 3 * (2 * 4 * 16 * 2)
        assert summary["compute"]["measured_step"] == 0
    else:  # died in the measured step's forward: what was counted is kept, marked incomplete
        assert summary["flops_per_step"] is None
        assert summary["compute"]["complete"] is False
        assert summary["compute"]["flops"]["forward"] == 2 * 4 * 8 * 16 + 2 * 4 * 16 * 2
    assert 'id="compute"' in (out / "report.html").read_text()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_summary_step_time_leaves_out_the_counted_step() -> None:
    from memdoctor.analysis.summary import unperturbed
    from memdoctor.trace import StepRecord

    def step(i: int, perturbed: bool) -> StepRecord:
        extra = {"flops": {"perturbed": True}} if perturbed else {}
        return StepRecord(i, False, True, 10.0 * (1 + 9 * perturbed), {}, 1, {}, {}, {}, collectors=extra)

    steps = [step(0, True), step(1, False), step(2, False)]
    assert [s.step for s in unperturbed(steps)] == [1, 2]
    assert [s.step for s in unperturbed(steps[:1])] == [0]  # nothing else left: keep it
