"""Activation and gradient histograms: planted fp16 overflow and tiny gradients are found in the right
layer with the right fractions; the hooks never read the device and keep nothing alive; timing steps
measure nothing; the precision rules and verdict; the report section, also for traces without it."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from tracebuilder import TraceBuilder, tiny_mlp, trace_from_records

from memdoctor.analysis import histograms as pr
from memdoctor.capture import histograms as hist
from memdoctor.capture import histsample
from memdoctor.capture.session import ProfileSession
from memdoctor.device import FakeDevice
from memdoctor.report import build_summary, render
from memdoctor.report.sections import precision as precision_section
from memdoctor.trace import Trace, load_trace

DATA = Path(__file__).parent / "data"


class Scale(nn.Module):
    """Multiplies its input by ``factor`` (the planted fp16 overflow: 1e6)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _ShrinkGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class ShrinkGrad(nn.Module):
    """Identity forward; multiplies the gradient flowing back through it by ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShrinkGrad.apply(x, self.factor)


class Net(nn.Module):
    """in -> Linear -> tanh -> [planted] -> Linear -> out."""

    def __init__(self, planted: nn.Module | None = None, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.act = nn.Tanh()
        self.planted = planted or nn.Identity()
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.planted(self.act(self.inp(x))))


def run(
    model: nn.Module,
    *,
    steps: int = 2,
    warmup: int = 1,
    device: Any = None,
    batch: int = 8,
    spy: dict[str, list[torch.Tensor]] | None = None,
    spy_on: str = "planted",
) -> list[dict[str, Any]]:
    """Profile ``model`` with the histogram collector only; ``spy`` collects the outputs of module
    ``spy_on`` and their gradients, as the script sees them (for the expected figures)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same model every step: only the data varies
    records: list[dict[str, Any]] = []
    session = ProfileSession(
        steps=steps, warmup=warmup, sink=records.append, device=device, collectors=[hist.HistogramCollector()]
    )
    handles = []
    if spy is not None:
        handles.append(model.get_submodule(spy_on).register_forward_hook(_spy(spy)))
    with session:
        for _ in range(steps + warmup + 2):
            model(torch.randn(batch, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    for h in handles:
        h.remove()
    return records


def _spy(store: dict[str, list[torch.Tensor]]) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        store.setdefault("out", []).append(out.detach().clone())
        out.register_hook(lambda g: store.setdefault("grad", []).append(g.detach().clone()))

    return hook


def final_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if r["type"] == "step"}


def write(tmp_path: Path, records: list[dict[str, Any]], **device: Any) -> Trace:
    cpu = TraceBuilder(kind="cpu").header["device"]
    return trace_from_records(
        tmp_path / "trace.jsonl.gz", records, device={**cpu, **device}, collectors=["histograms"]
    )


def index_of(model: nn.Module, name: str) -> int:
    return [n for n, _ in model.named_modules()].index(name)


def entry(rec: dict[str, Any], direction: str, module: int) -> tuple[dict[str, list[Any]], int]:
    cols = rec["collectors"]["histograms"]["models"]["0"][direction]
    return cols, cols["module"].index(module)


# ----------------------------------------------------------------------------------------- planted


def test_planted_fp16_overflow_is_found_in_its_layer_with_its_fraction(tmp_path: Path) -> None:
    spy: dict[str, list[torch.Tensor]] = {}
    model = Net(Scale(1e6))
    records = run(model, spy=spy)
    steps = final_steps(records)
    planted = index_of(model, "planted")
    for k, rec in steps.items():
        cols, i = entry(rec, "forward", planted)
        out = spy["out"][k]
        assert cols["sampled"][i] == out.numel()  # 8 x 32 values: the sample is the whole tensor
        assert cols["overflow"][i] == int((out.abs() > 65504).sum())
        assert cols["abs_max"][i] == pytest.approx(out.abs().max().item(), rel=1e-5)
        expected = (out.abs() > 65504).float().mean().item()
        assert rec["modules"]["0"]["fp16_overflow_fraction"][planted] == pytest.approx(expected)
        assert 0.3 < expected < 1.0  # tanh outputs above 0.0655 overflow once scaled: most, not all
        # the layers before it are clean
        assert rec["modules"]["0"]["fp16_overflow_fraction"][index_of(model, "act")] == 0
    summary = build_summary(write(tmp_path, records))
    rows = {r["name"]: r for r in summary["layers"]}
    total = torch.cat([o.flatten() for o in spy["out"][: len(steps)]])
    assert rows["planted"]["fp16_overflow_fraction"] == pytest.approx(
        (total.abs() > 65504).float().mean().item(), abs=1e-4
    )
    assert rows["act"]["fp16_overflow_fraction"] == 0 and rows["inp"]["fp16_overflow_fraction"] == 0
    result = summary["precision"]
    assert result["verdict"] == "bf16_only"
    finding = next(f for f in result["findings"] if f["rule"] == "activation_overflow")
    assert finding["layers"][0] == "planted"  # where it appears; the root repeats out's tensor
    assert "" not in finding["layers"] and "(Net)" not in finding["evidence"]


@pytest.mark.parametrize("factor", [1e-6, 1e-14])
def test_planted_tiny_gradient_shows_underflow(tmp_path: Path, factor: float) -> None:
    spy: dict[str, list[torch.Tensor]] = {}
    model = Net(ShrinkGrad(factor))
    records = run(model, spy=spy, spy_on="act")
    act = index_of(model, "act")  # the gradient flowing back into act's output is the shrunk one
    rec = final_steps(records)[1]
    cols, i = entry(rec, "backward", act)
    grad = spy["grad"][1]
    expected = ((grad.abs() < 2**-14) & (grad != 0)).float().mean().item()
    assert rec["modules"]["0"]["grad_fp16_underflow_fraction"][act] == pytest.approx(expected)
    assert expected == 1.0
    assert rec["modules"]["0"]["grad_fp16_underflow_fraction"][index_of(model, "out")] == 0
    assert cols["abs_max"][i] == pytest.approx(grad.abs().max().item(), rel=1e-5)
    summary = build_summary(write(tmp_path, records))
    result = summary["precision"]
    under = [f for f in result["findings"] if f["rule"] == "gradient_underflow"]
    if factor == 1e-6:
        # Gradients around 1e-8 are subnormal in fp16 but survive GradScaler's 2^16 scale.
        assert under == [] and result["verdict"] == "fp16_safe"
        lo, hi = result["scale_window_log2"]
        assert lo <= 16 <= hi and lo > 0
    else:
        # Below 2^-40 even a 2^16 scale cannot save them, and the other layers' gradients cap the scale.
        # act's output gradient is the shrunk one, and inp's inherits it; planted and out are clean
        assert sorted(name for f in under for name in f["layers"]) == ["act", "inp"]
        assert result["verdict"] == "bf16_only" and result["scale_window_log2"] is None


def test_histogram_counts_add_up_to_the_sample() -> None:
    model = Net(Scale(3.0), width=512)
    records = run(model, batch=64)  # 64 x 512 = 32768 values an output: sampled, not copied whole
    rec = final_steps(records)[1]
    for direction in ("forward", "backward"):
        cols = rec["collectors"]["histograms"]["models"]["0"][direction]
        for i in range(len(cols["module"])):
            assert cols["sampled"][i] <= hist.SAMPLE_SIZE
            assert sum(cols["counts"][i]) + cols["zero"][i] + cols["nonfinite"][i] == cols["sampled"][i]
    cols, i = entry(rec, "forward", index_of(model, "planted"))
    assert cols["numel"][i] == 64 * 512 and 2048 < cols["sampled"][i] <= hist.SAMPLE_SIZE


@pytest.mark.parametrize("make", ["contiguous", "transposed", "sliced", "scalar"])
def test_sample_is_bounded_and_spread(make: str) -> None:
    torch.manual_seed(0)
    base = torch.randn(40, 96, 48)
    x = {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "sliced": base[:, 3:90, ::2],
        "scalar": base[0, 0, 0],
    }[make]
    row = torch.full((hist.SAMPLE_SIZE,), float("nan"))
    k = histsample.copy_sample(x, row)
    assert 0 < k <= min(hist.SAMPLE_SIZE, x.numel()) and not row[:k].isnan().any()
    assert set(row[:k].tolist()) <= set(x.flatten().tolist())  # values of x, nothing else
    if x.numel() > hist.SAMPLE_SIZE:
        assert k > hist.SAMPLE_SIZE // 4
        assert row[:k].std().item() == pytest.approx(1.0, abs=0.1)  # a spread, not one channel


def test_contiguous_sample_covers_every_channel() -> None:
    x = torch.arange(32 * 128 * 768, dtype=torch.float32).view(32, 128, 768)
    row = torch.empty(hist.SAMPLE_SIZE)
    k = histsample.copy_sample(x, row)
    channels = {int(v) % 768 for v in row[:k].tolist()}
    assert len(channels) > 700  # a stride that is a multiple of 768 would sample one channel only


def test_nonfinite_and_zero_bins() -> None:
    rows = histsample.DeviceRows(torch.device("cpu"))
    values = torch.tensor([0.0, 0.0, float("inf"), float("nan"), 1e5, 3.0, 2.0**-30, -(2.0**-60), 2.0**60])
    for dtype in (torch.float32, torch.float64):
        sample, lo, hi = rows.slot(dtype)
        torch.aminmax(values.to(dtype), out=(lo, hi))
        n = histsample.copy_sample(values.to(dtype), sample)
        rows.rows.append(histsample.Row(1, 0, dtype, values.numel(), n))
    for stats in histsample.device_stats(rows):
        abs_max, overflow, counts = stats[0], stats[1], stats[2:]
        assert math.isnan(abs_max)  # a NaN anywhere: the exact max says so
        assert overflow == 3  # inf, 1e5, 2^60 (NaN is not an overflow)
        assert counts[0] == 2 and counts[hist.EXP_BINS + 1] == 2  # zeros; inf and NaN
        exps = {hist.LOG2_MIN + k: int(c) for k, c in enumerate(counts[1 : hist.EXP_BINS + 1]) if c}
        assert exps == {16: 1, 1: 1, -30: 1, hist.LOG2_MIN: 1, hist.LOG2_MAX: 1}


# ----------------------------------------------------------------------------------------- cost


class _HostRead(Exception):
    pass


def test_hooks_never_read_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item(), .cpu(), .tolist(), bool(tensor) ... inside the module and backward hooks: on a GPU
    each would wait for the device. step_field is the one place that reads, once per step."""
    inside: list[str] = []
    reads: list[str] = []
    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def guard(self: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
            if inside:
                reads.append(f"{_name} in {inside[-1]}")
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, guard)
    for hook in ("on_forward_post", "on_backward", "on_forward_pre", "on_optimizer_end", "on_step_start"):
        original = getattr(hist.HistogramCollector, hook)

        def wrapped(self: Any, *a: Any, _hook: str = hook, _orig: Any = original) -> Any:
            inside.append(_hook)
            try:
                return _orig(self, *a)
            finally:
                inside.pop()

        monkeypatch.setattr(hist.HistogramCollector, hook, wrapped)
    records = run(Net(Scale(1e6)))
    assert reads == []
    assert all("histograms" in r["collectors"] for r in final_steps(records).values())


def test_outputs_and_gradients_are_freed_when_the_script_drops_them() -> None:
    model = Net(Scale(2.0), width=1024)
    collector = hist.HistogramCollector()
    session = ProfileSession(steps=1, warmup=0, collectors=[collector])
    refs: list[weakref.ref[torch.Tensor]] = []

    def watch(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        refs.append(weakref.ref(out))
        out.register_hook(lambda g: refs.append(weakref.ref(g)) or None)

    handles = [m.register_forward_hook(watch) for m in model.modules()]
    with session:
        loss = model(torch.randn(256, 16)).pow(2).mean()
        loss.backward()
        del loss
        gc.collect()
        assert collector._devices[torch.device("cpu")].rows  # they were measured
        assert len(refs) == 2 * len(list(model.modules()))
        assert [r for r in refs if r() is not None] == []  # and freed, as without memdoctor
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    for h in handles:
        h.remove()
    # the collector's buffers are a fixed few rows, not proportional to the 1 MiB outputs it measured
    held = sum(t.numel() * t.element_size() for r in collector._devices.values() for t in r.samples)
    assert held <= histsample.CHUNK_ROWS * hist.SAMPLE_SIZE * 4


def test_timing_steps_measure_nothing() -> None:
    calls: list[int] = []
    original = hist.HistogramCollector._record

    def counting(self: hist.HistogramCollector, *a: Any) -> None:
        calls.append(self._step)
        original(self, *a)

    hist.HistogramCollector._record = counting  # type: ignore[method-assign]
    try:
        records = run(Net(Scale(1e6)), steps=4, warmup=1, device=FakeDevice())
    finally:
        hist.HistogramCollector._record = original  # type: ignore[method-assign]
    steps = final_steps(records)
    assert [steps[k]["detail"] for k in sorted(steps)] == ["full", "full", "timing", "timing", "full"]
    assert [k for k in sorted(steps) if "histograms" in steps[k].get("collectors", {})] == [0, 1, 4]
    assert set(calls) == {0, 1, 4}
    assert "fp16_overflow_fraction" not in steps[2]["modules"].get("0", {})


def test_provisional_and_final_records_carry_the_same_data() -> None:
    records = run(Net(Scale(1e6)))
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["type"] == "step":
            by_step.setdefault(r["step"], []).append(r["collectors"]["histograms"])
    assert any(len(v) == 2 for v in by_step.values())
    assert all(v[0] == v[-1] for v in by_step.values())
    described = next(r for r in records if r["type"] == "collector")
    assert described["data"]["sample_size"] == hist.SAMPLE_SIZE


# ----------------------------------------------------------------------------------------- rules


def synthetic(
    grads: dict[str, list[float]], outputs: dict[str, list[float]] | None = None, **device: Any
) -> Trace:
    """A hand-built trace whose modules output ``outputs[name]`` and receive ``grads[name]``."""
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    trace = b.add_steps(warmup=0, profiled=1).end("completed").build()
    trace.header["device"].update(device)
    names = trace.models[0].names
    model: dict[str, Any] = {}
    for direction, values in (("forward", outputs or {}), ("backward", grads)):
        cols = hist._empty_columns()
        for name, xs in values.items():
            _add(cols, names.index(name), xs)
        model[direction] = cols
    trace.steps[0].collectors["histograms"] = {"models": {"0": model}}
    return trace


def _add(cols: dict[str, list[Any]], module: int, xs: list[float]) -> None:
    t = torch.tensor(xs)
    stats = [t.abs().max().item(), float((t.abs() > 65504).sum())]
    counts = [0] * (hist.EXP_BINS + 2)
    for x in xs:
        if x == 0:
            counts[0] += 1
        elif not math.isfinite(x):
            counts[-1] += 1
        else:
            e = min(max(math.floor(math.log2(abs(x))), hist.LOG2_MIN), hist.LOG2_MAX)
            counts[e - hist.LOG2_MIN + 1] += 1
    hist._append(cols, module, histsample.Row(0, 0, torch.float32, len(xs), len(xs)), stats + counts)


def test_gradients_that_need_a_smaller_scale() -> None:
    # |g| up to 8: a 2^16 scale overflows (8 * 65536 > 65504); 2^12 keeps everything inside
    trace = synthetic({"0": [8.0, 1.0, 2.0**-20], "2": [2.0**-10] * 3})
    result = pr.precision(trace)
    assert result is not None and result["verdict"] == "fp16_rescale"
    assert result["scale_window_log2"] == [-4, 12] and result["suggested_init_scale_log2"] == 12
    assert [f["rule"] for f in result["findings"]] == ["scaled_gradient_overflow"]


def test_gradients_that_need_a_larger_scale() -> None:
    # 2^-45 needs a scale of 2^21 to reach fp16's 2^-24; the largest, 2^-6, allows up to 2^21
    trace = synthetic({"0": [2.0**-45] * 10 + [2.0**-6]})
    result = pr.precision(trace)
    assert result is not None and result["verdict"] == "fp16_rescale"
    assert result["scale_window_log2"] == [21, 21] and result["suggested_init_scale_log2"] == 21
    assert [f["rule"] for f in result["findings"]] == ["gradient_underflow"]


def test_the_loss_and_its_gradient_are_not_judged() -> None:
    # A scalar output is the loss: fp32 under autocast, its gradient 1 (the loss scale, once scaled).
    trace = synthetic({"": [1.0], "0": [0.5, 2.0**-20]}, {"": [1e6]})
    result = pr.precision(trace)
    assert result is not None and result["verdict"] == "fp16_safe" and result["findings"] == []


def test_safe_and_the_turing_note() -> None:
    trace = synthetic({"0": [0.5, 2.0**-20]}, {"0": [3.0, -40000.0]}, capability=[7, 5])
    result = pr.precision(trace)
    assert result is not None and result["verdict"] == "fp16_safe"
    assert result["bf16_available"] is False
    assert [f["rule"] for f in result["findings"]] == ["no_bf16"]
    assert "7.5" in result["findings"][0]["evidence"]


def test_overflow_on_a_card_without_bf16_says_so_in_the_report() -> None:
    trace = synthetic({"0": [0.5]}, {"2": [70000.0, 1.0]}, capability=[7, 5])
    summary = build_summary(trace)
    assert summary["precision"]["verdict"] == "bf16_only"
    html = render.render_report(trace, summary)
    assert "has no native bf16" in html and 'id="precision-layers"' in html
    ampere = synthetic({"0": [0.5]}, {"2": [70000.0, 1.0]}, capability=[8, 0])
    assert pr.precision(ampere)["bf16_available"] is True  # type: ignore[index]


def test_the_collectors_own_note_is_the_reason() -> None:
    trace = synthetic({})
    trace.steps[0].collectors.clear()
    trace.header["not_measured"] = ["histograms: this memdoctor build has no histograms collector"]
    html = render.render_report(trace, build_summary(trace))
    assert "Not measured: this memdoctor build has no histograms collector." in html


def test_damaged_histogram_data_is_left_out() -> None:
    trace = synthetic({"0": [0.5]})
    cols = trace.steps[0].collectors["histograms"]["models"]["0"]["backward"]
    cols["module"] = [999]  # not in the module table
    assert pr.precision(trace) is None
    summary = build_summary(trace)
    assert summary["precision"] is None and summary["layers"][1]["grad_fp16_underflow_fraction"] is None
    html = render.render_report(trace, summary)
    assert "Not measured: no step of this run recorded activation histograms" in html


# ----------------------------------------------------------------------------------------- report


def test_report_renders_the_precision_section(tmp_path: Path) -> None:
    trace = write(tmp_path, run(Net(Scale(1e6))))
    summary = build_summary(trace)
    ctx = precision_section.report_section(trace, summary)
    assert ctx is not None and ctx["chart"].startswith("data:image/svg+xml;base64,")
    outputs = [r for r in ctx["rows"] if r["what"] == "output"]
    assert outputs[0]["name"] == "planted" and outputs[0]["overflow"] > 0.3
    html = render.render_report(trace, summary)
    assert 'id="precision"' in html and 'id="precision-verdict"' in html and "only bf16 is safe" in html


def test_recorded_gpu_trace_has_a_verdict_and_layer_ranges() -> None:
    # BERT-base fp32 on the H200: every timed layer measured, nothing beyond fp16's range.
    trace = load_trace(DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz")
    summary = build_summary(trace)
    assert summary["precision"]["verdict"] == "fp16_safe"
    measured = [r for r in summary["layers"] if r["fp16_overflow_fraction"] is not None]
    assert len(measured) >= 12 and all(r["fp16_overflow_fraction"] == 0 for r in measured)
    assert precision_section.report_section(trace, summary) is not None


@pytest.mark.parametrize(
    "path", [DATA / "pre-collectors-bert-base-b8-s128-8gib.jsonl.gz"], ids=lambda p: p.name.split(".")[0]
)
def test_recorded_traces_without_histograms_say_not_measured(path: Path) -> None:
    trace = load_trace(path)
    summary = build_summary(trace)
    assert summary["precision"] is None
    assert all(r["fp16_overflow_fraction"] is None for r in summary["layers"])
    assert all(r["grad_fp16_underflow_fraction"] is None for r in summary["layers"])
    assert precision_section.report_section(trace, summary) is None
    html = render.render_report(trace, summary)
    start = html.index('id="precision"')
    assert "Not measured:" in html[start : start + 600]
