"""Gradient norms: measured on the device at the optimizer step, read once per step in ``build_step``;
NaN/Inf traced to the module where it appeared; vanishing and exploding flags; the report's section."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from tracebuilder import TraceBuilder, bert_like, completed_trace, trace_from_records

from memdoctor.analysis import gradnorms as an
from memdoctor.capture import gradnorms
from memdoctor.capture.session import ProfileSession
from memdoctor.device import FakeDevice
from memdoctor.report import build_summary, render
from memdoctor.trace import StepRecord, Trace

BLOCKS = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Registered in the opposite order of use: model order and backward order differ inside it.
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x))) + x


class TiedNet(nn.Module):
    """Embedding, a stack of blocks, and an output layer tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


Plant = Callable[[TiedNet, int], Any]


def train(
    session: ProfileSession, model: TiedNet, plant: Plant | None = None, steps: int = 6
) -> list[dict[str, torch.Tensor]]:
    """Train until the session is done; returns each step's gradients, read after the profiler's hooks."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grads: list[dict[str, torch.Tensor]] = []
    with session:
        for step in range(steps):
            handles = plant(model, step) if plant else []
            tokens = torch.randint(0, 10, (4, 5))
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            for h in handles:
                h.remove()
            if session._done:
                break
    return grads


def profile(plant: Plant | None = None, device: Any = None) -> tuple[list[dict[str, Any]], TiedNet, list]:
    torch.manual_seed(0)
    model = TiedNet()
    records: list[dict[str, Any]] = []
    grads = train(ProfileSession(steps=3, warmup=1, sink=records.append, device=device), model, plant)
    return records, model, grads


def final_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last record of each step (a provisional one is superseded)."""
    return {r["step"]: r for r in records if r["type"] == "step"}


def index_of(model: nn.Module, name: str) -> int:
    return [n for n, _ in model.named_modules()].index(name)


def write(tmp_path: Path, records: list[dict[str, Any]]) -> Trace:
    return trace_from_records(tmp_path / "trace.jsonl.gz", records)


def scale_grads(module_name: str, factor: float, at_step: int | None = None) -> Plant:
    """A plant that multiplies every parameter gradient of one module (at one step, or at every step)."""

    def plant(model: TiedNet, step: int) -> list[Any]:
        if at_step is not None and step != at_step:
            return []
        module = model.get_submodule(module_name)
        return [p.register_hook(lambda g: g * factor) for p in module.parameters()]

    return plant


# ----------------------------------------------------------------------------------------- measurement


def test_norms_equal_vector_norms_computed_independently() -> None:
    records, model, grads = profile()
    steps = final_steps(records)
    assert sorted(steps) == [0, 1, 2, 3]
    names = [n for n, _ in model.named_modules()]
    for k, rec in steps.items():
        col = rec["modules"]["0"]["grad_norm"]
        for i, name in enumerate(names):
            # named_parameters() lists the tied weight once, as emb.weight: "out" owns nothing
            own = [g for n, g in grads[k].items() if n.rpartition(".")[0] == name]
            if not own:
                assert col[i] is None, name
                continue
            expected = math.sqrt(sum(torch.linalg.vector_norm(g).item() ** 2 for g in own))
            assert col[i] == pytest.approx(expected, rel=1e-5), name
        total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads[k].values()])).item()
        assert rec["grad_norm"]["global"] == pytest.approx(total, rel=1e-5)
        assert rec["grad_norm"]["nonfinite_modules"] == [] and rec["grad_norm"]["first_nonfinite"] is None
        derived = an.step_grad_norm(StepRecord.from_record(rec))  # from the columns, as a reader does
        assert derived == {**rec["grad_norm"], "global": pytest.approx(rec["grad_norm"]["global"], rel=1e-5)}


def test_collect_launches_one_tensor_and_reads_nothing() -> None:
    model = TiedNet()
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    flat = [(p, (0, i)) for i, m in enumerate(model.modules()) for p in m.parameters(recurse=False)]
    norms = gradnorms.collect(flat)
    assert norms is not None and norms._host is None  # nothing was read to the host
    assert len(norms.tensors) == 1 and isinstance(norms.tensors[0], torch.Tensor)
    assert norms.tensors[0].dtype == torch.float32 and norms.tensors[0].shape == (len(norms.locs),)
    assert len(norms.locs) == len(list(model.parameters()))  # the tied weight once


def test_fallback_without_foreach_gives_the_same_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = [torch.randn(3, 4), torch.randn(5).half() * 1000]
    fused = gradnorms.device_norms(grads)
    monkeypatch.delattr(torch, "_foreach_norm")
    assert torch.allclose(gradnorms.device_norms(grads), fused)


class _Watched(torch.Tensor):
    """Records the call stack of every read of its values to the host."""

    reads: ClassVar[list[list[str]]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("tolist", "item", "cpu", "numpy", "__float__", "to"):
            cls.reads.append([f.function for f in inspect.stack()])
        return super().__torch_function__(func, types, args, kwargs or {})


def test_norms_are_read_to_the_host_only_in_build_step(monkeypatch: pytest.MonkeyPatch) -> None:
    launch = gradnorms.device_norms
    monkeypatch.setattr(gradnorms, "device_norms", lambda grads: launch(grads).as_subclass(_Watched))
    _Watched.reads = []
    records, _, _ = profile()
    assert _Watched.reads, "the norms were never read"
    assert all("build_step" in stack for stack in _Watched.reads)
    assert all(r["grad_norm"]["global"] > 0 for r in final_steps(records).values())


def test_timing_steps_measure_no_norms() -> None:
    records, _, _ = profile(device=FakeDevice())
    steps = final_steps(records)
    assert [steps[k]["detail"] for k in sorted(steps)] == ["full", "full", "timing", "full"]
    assert steps[2]["grad_norm"] is None and steps[2]["modules"] == {}
    assert all(steps[k]["grad_norm"]["global"] > 0 for k in (0, 1, 3))


# ----------------------------------------------------------------------------------------- NaN / Inf


def test_planted_nan_names_its_module_and_the_trace_loads(tmp_path: Path) -> None:
    records, model, _ = profile(scale_grads("layers.3.lin", float("nan"), at_step=3))
    rec = final_steps(records)[3]
    lin = index_of(model, "layers.3.lin")
    assert rec["grad_norm"] == {"global": None, "nonfinite_modules": [[0, lin]], "first_nonfinite": [0, lin]}
    assert rec["modules"]["0"]["grad_norm"][lin] is None
    assert rec["modules"]["0"]["grad_nonfinite"][lin] == 1
    trace = write(tmp_path, records)
    summary = build_summary(trace)
    assert summary["grad_norm"][-1] == {"step": 3, "global": None}
    assert [f for f in summary["grad_flags"] if f["kind"] == "nonfinite"] == [
        {
            "kind": "nonfinite",
            "module": "layers.3.lin",
            "step": 3,
            "evidence": "NaN/Inf gradient in 1 module; it appeared first in layers.3.lin"
            " (in 1 of 4 steps measured)",
        }
    ]


def _nan_at_block_output(block: int, at_step: int) -> Plant:
    def plant(model: TiedNet, step: int) -> list[Any]:
        if step != at_step:
            return []

        def poison(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: g * float("nan"))

        return [model.layers[block].register_forward_hook(poison)]

    return plant


@pytest.mark.parametrize("at_step", [0, 2], ids=["first-step-reverse-model-order", "backward-order"])
def test_a_nan_that_flows_backward_is_traced_to_where_it_appeared(at_step: int) -> None:
    records, model, _ = profile(_nan_at_block_output(3, at_step))
    field = final_steps(records)[at_step]["grad_norm"]
    names = [n for n, _ in model.named_modules()]
    bad = [names[i] for _, i in field["nonfinite_modules"]]
    # Backward carries the NaN from layers.3's output to every module before it; the ones after are clean.
    assert sorted(bad) == sorted(["emb"] + [f"layers.{b}.{m}" for b in range(4) for m in ("lin", "norm")])
    # norm runs last in the block's forward, so its gradient is the first to be NaN. On step 0 (no
    # gradient hooks yet) reverse model order picks lin; from then on the backward order is known.
    assert names[field["first_nonfinite"][1]] == ("layers.3.lin" if at_step == 0 else "layers.3.norm")


# ----------------------------------------------------------------------------------------- flags


def test_planted_vanishing_layer_is_flagged(tmp_path: Path) -> None:
    records, _, _ = profile(scale_grads("layers.4", 1e-9))
    summary = build_summary(write(tmp_path, records))
    flags = summary["grad_flags"]
    assert [(f["kind"], f["module"], f["step"]) for f in flags] == [("vanishing", "layers.4", 0)]
    assert "below the median of its neighbours" in flags[0]["evidence"]
    layer4 = next(row for row in summary["layers"] if row["name"] == "layers.4.lin")
    assert 0 < layer4["grad_norm"] < 1e-6


def _with_norms(trace: Trace, norm: Callable[[str, int], float | None]) -> Trace:
    """Give every step of a hand-built trace gradient-norm columns: ``norm(module name, step)``."""
    info = trace.models[0]
    for step in trace.steps:
        values = [
            norm(n, step.step) if b else None for n, b in zip(info.names, info.param_bytes, strict=True)
        ]
        step.modules[0]["grad_norm"] = values
        step.modules[0]["grad_nonfinite"] = [0] * len(values)
    return trace


def _bert(layers: int = 6) -> Trace:
    b = TraceBuilder()
    b.add_model(bert_like(layers))
    return b.add_steps(warmup=1, profiled=3).end("completed").build()


def test_vanishing_needs_orders_of_magnitude() -> None:
    small = _with_norms(_bert(), lambda n, s: 0.5 if n.startswith("bert.encoder.layer.4.") else 1.0)
    assert an.grad_flags(small) == []
    tiny = _with_norms(_bert(), lambda n, s: 1e-9 if n.startswith("bert.encoder.layer.4.") else 1.0)
    flags = an.grad_flags(tiny)
    assert [(f["kind"], f["module"], f["step"]) for f in flags] == [("vanishing", "bert.encoder.layer.4", 0)]
    assert flags[0]["evidence"].endswith("(in 4 of 4 steps measured)")


def test_exploding_by_threshold_and_by_ratio() -> None:
    spike = _with_norms(_bert(), lambda n, s: 1e5 if s == 2 and n.endswith("classifier") else 1e-3)
    flags = an.grad_flags(spike)
    assert [(f["kind"], f["module"], f["step"]) for f in flags] == [("exploding", "classifier", 2)]
    assert "above 1e+04" in flags[0]["evidence"]
    ratio = _with_norms(_bert(), lambda n, s: 1e-3 * (5000 if s == 3 else 1))
    flags = an.grad_flags(ratio)
    assert [(f["kind"], f["step"]) for f in flags] == [("exploding", 3)]
    assert "the median of the other steps" in flags[0]["evidence"]


def test_a_trace_without_norms_says_not_measured() -> None:
    trace = completed_trace(layers=2)
    summary = build_summary(trace)
    assert summary["grad_norm"] == [] and summary["grad_flags"] == []
    assert all(row["grad_norm"] is None for row in summary["layers"])
    context = render.report_context(trace, summary)
    assert context["grad_chart"] is None
    assert 'id="grad-norms"' in render.render_report(trace, summary)


# ----------------------------------------------------------------------------------------- report


def test_report_renders_the_gradient_norm_section(tmp_path: Path) -> None:
    records, _, _ = profile(scale_grads("layers.4", 1e-9))
    trace = write(tmp_path, records)
    chart = an.grad_norm_chart(trace)
    assert chart is not None and len(chart["steps"]) == 4
    assert chart["layers"][:3] == ["emb", "layers.0.norm", "layers.0.lin"]  # every owner of parameters
    layer4 = chart["layers"].index("layers.4.lin")
    assert all(st["norms"][layer4] < 1e-6 for st in chart["steps"])
    summary = build_summary(trace)
    context = render.report_context(trace, summary)
    assert context["grad_chart"].startswith("data:image/svg+xml;base64,")
    html = render.render_report(trace, summary)
    assert 'id="grad-norms"' in html and 'id="grad-flags"' in html


def test_big_models_chart_their_top_level_layers() -> None:
    trace = _with_norms(_bert(12), lambda n, s: 1.0)
    chart = an.grad_norm_chart(trace)
    assert chart is not None
    assert "bert.encoder.layer.0" in chart["layers"]
    assert "bert.encoder.layer.0.output.dense" not in chart["layers"]
    # a block's norm covers its eight parameterised submodules (q, k, v, three dense, two LayerNorms)
    k = chart["layers"].index("bert.encoder.layer.0")
    assert chart["steps"][0]["norms"][k] == pytest.approx(math.sqrt(8))


def test_float64_and_mixed_gradients_have_norms() -> None:
    """A float64 model (LBFGS examples, scientific code) has float64 gradients: their norms are taken
    in float64 (a float32 norm of them is refused by torch) and returned as float32 like the rest."""
    grads = [torch.full((3,), 2.0, dtype=torch.float64), torch.full((4,), 1.0), torch.full((1,), 3.0).half()]
    norms = gradnorms.device_norms(grads)
    assert norms.dtype == torch.float32
    assert torch.allclose(norms, torch.tensor([12**0.5, 2.0, 3.0]))
