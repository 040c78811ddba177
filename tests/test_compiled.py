"""Profiling a ``torch.compile``d model (issue 19, point 7): memdoctor's own hooks break no graph, the
model runs compiled, and the trace and summary say what dynamo did, graph breaks of the script's own
included. In process (``memdoctor.profile``), with dynamo's ``eager`` backend (no C compiler needed);
slow only for dynamo's first import and tracing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memdoctor
from memdoctor.capture.compiled import in_compiled_call
from memdoctor.trace import load_trace

dynamo = pytest.importorskip("torch._dynamo")
pytestmark = pytest.mark.slow


class Breaking(nn.Module):
    """Two linears with a graph break of the script's own between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h)


def _run(tmp_path: Path, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Profile 2 steps (1 warm-up) of ``model`` compiled, called with plain tensors (no DataLoader:
    the data collector's forward hooks run, the graph break of issue 19). Returns the trace's
    ``compile`` record and the summary."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memdoctor.profile(tmp_path / "o", steps=2, warmup=1, collect="all") as prof:
        for _ in range(4):
            compiled(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert prof.trace_path is not None and prof.summary_path is not None
    record = load_trace(prof.trace_path).collected["compile"]
    return record, json.loads(prof.summary_path.read_text())


def test_memdoctor_breaks_no_graph_and_the_model_runs_compiled(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    record, summary = _run(tmp_path, model)
    assert dict(dynamo.utils.counters["graph_break"]) == {}
    assert record["graphs"] >= 1 and record["graph_breaks"] == 0
    assert record["frames"] == record["frames_compiled"]  # no frame fell back to eager
    assert "ran compiled" in summary["compiled"]["text"]
    # The compiled region is the model's one call: what it saves is the model's, not the loop's.
    root = next(r for r in summary["layers"] if r["depth"] == 0)
    assert root["activation_bytes"] > 0


def test_the_scripts_own_graph_break_is_counted_and_reported(tmp_path: Path) -> None:
    record, summary = _run(tmp_path, Breaking())
    assert record["graph_breaks"] >= 1 and record["graphs"] >= 2
    text = summary["compiled"]["text"]
    assert "graph break(s)" in text and "slower" in text


def test_a_compiled_optimizer_step_breaks_once_at_memdoctors_hook_and_says_so(tmp_path: Path) -> None:
    """The optimizer-step hooks must run to find steps: called from a compiled ``optimizer.step()``
    they run eagerly (one deliberate break each call site), counted as memdoctor's."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def step() -> None:  # a compiled training-step function that steps the optimizer
        opt.step()

    with memdoctor.profile(tmp_path / "o", steps=2, warmup=1, collect="none") as prof:
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            step()
            opt.zero_grad()
    assert prof.summary_path is not None
    summary = json.loads(prof.summary_path.read_text())
    assert summary["steps_profiled"] == 2  # steps were found through the compiled step
    c = summary["compiled"]
    assert c["memdoctor_breaks"] >= 1 and "memdoctor's optimizer-step hooks" in c["text"]


def test_a_compiled_model_fed_plain_tensors_keeps_its_batch_traits_without_a_graph_break(
    tmp_path: Path,
) -> None:
    """No DataLoader: the traits come from the model's call. The model's own hooks are traced away in
    the compiled forward; the compiled wrapper's run in eager code around it."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memdoctor.profile(tmp_path / "o", steps=2, warmup=1, collect="data") as prof:
        for _ in range(4):
            out = compiled(torch.randint(0, 50, (4, 7)))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    assert dict(dynamo.utils.counters["graph_break"]) == {}
    assert prof.trace_path is not None
    trace = load_trace(prof.trace_path)
    for step in trace.steps[1:]:  # step 0 runs before the model is discovered (as without compile)
        data = step.collectors["data"]
        assert data["source"] == "forward"
        assert [(b["batch_size"], b["shapes"]) for b in data["batches"]] == [(4, {"0": [4, 7]})]  # once
    loss = trace.collected["data"]["loop"]["loss"]
    assert loss is not None and loss["in_forward"] is False  # the model's output was seen


def test_torchs_global_hooks_warning_is_hushed_only_while_memdoctors_hooks_are_in(tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with memdoctor.profile(tmp_path / "o", steps=2, warmup=1, collect="none"):
            for _ in range(4):
                compiled(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        during = [w for w in seen if "global hooks" in str(w.message)]
        # The script's own global hook: the warning is its own, and it is given.
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
        try:
            compiled(torch.randn(4, 8))
        finally:
            handle.remove()
    assert during == []
    assert any("global hooks" in str(w.message) for w in seen)


def test_in_compiled_call_is_true_only_under_a_compiled_call() -> None:
    """The FLOP counter's guard: eager code called from a compiled function (a disabled hook) is inside
    the compiled call; the same code called eagerly is not."""
    seen: list[bool] = []
    probe = torch.compiler.disable(lambda: seen.append(in_compiled_call()))

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        probe()
        return x + 1

    f(torch.ones(2))
    probe()
    assert seen == [True, False]


def test_a_compiled_model_under_runs_precision_gets_no_dynamo_warning_from_memdoctor(tmp_path: Path) -> None:
    """``memdoctor run``'s autocast lever asks which autocast is in force from inside the compiled
    forward; dynamo warned there about tracing through ``functools.cache`` (memdoctor's code, on the
    script's terminal). Run as ``memdoctor run`` runs a script, in process."""
    from tests.test_run import run_script

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "cm = torch.compile(m, backend='eager')\n"
        "for _ in range(3):\n"
        "    cm(torch.randn(4, 8)).float().pow(2).mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )
    dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lines = run_script(script, [], {"precision": "bf16"})
    assert any("autocast bf16" in line for line in lines), lines
    ours = [str(w.message) for w in seen if "memdoctor" in str(w.message) or "memdoctor" in w.filename]
    assert ours == []
