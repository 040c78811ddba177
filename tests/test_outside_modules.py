"""Memory outside every child module: what a root module's own forward code saves (a GPT's fp32 logits
and its loss) and what the training loop saves between forward and backward (``loss =
criterion(model(x), y)``), each by the line that saved it; in the trace, ``summary.json``, the plan and
the terminal's top table. On CPU through the tensor accounting (the saved-tensors hook), in process."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from tracebuilder import TraceBuilder, bert_like, trace_from_records

from memdoctor.analysis.layers import LOOP_HOLDER, outside_holders
from memdoctor.capture.session import ProfileSession
from memdoctor.cli.terminal import biggest_layers
from memdoctor.device import Device
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.memory import memory_parts
from memdoctor.report import build_summary
from memdoctor.trace import Trace
from memdoctor.trace.check import check_step

VOCAB, WIDTH, BATCH, SEQ = 64, 16, 8, 32
LOGITS_F32 = BATCH * SEQ * VOCAB * 4  # what log_softmax saves of the fp32 logits


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class TinyGPT(nn.Module):
    """The minimal-GPT shape: with targets, the loss is computed in the root's own forward, from an
    fp32 upcast of the logits, as nanoGPT-style scripts do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))  # ROOT_LOSS_LINE
        return logits, loss


def _line(marker: str, obj: Any) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))


def _profile(step: Any, model: nn.Module, tmp_path: Path) -> Trace:
    records: list[dict[str, Any]] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ProfileSession(steps=1, warmup=0, sink=records.append, device=Device()):
        for _ in range(2):
            step(model, *_batch())
            opt.step()
            opt.zero_grad()
    tmp_path.mkdir(parents=True, exist_ok=True)
    return trace_from_records(tmp_path / "trace.jsonl.gz", records)


def _root_loss(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> None:
    _, loss = model(idx, y)
    loss.backward()


def _loop_loss(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1)) + 1e-3 * (logits**2).mean()  # LOOP_LINE
    loss.backward()


def _criterion_loss(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.CrossEntropyLoss()(model(idx).view(-1, VOCAB), y.view(-1))  # CRITERION_LINE
    loss.backward()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trace, dict[str, Any]]:
    """TinyGPT computing its loss in its own forward, profiled once: (trace, summary)."""
    trace = _profile(_root_loss, TinyGPT(), tmp_path_factory.mktemp("root"))
    return trace, build_summary(trace)


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trace, dict[str, Any]]:
    """TinyGPT returning logits, the loss computed by the loop, profiled once: (trace, summary)."""
    trace = _profile(_loop_loss, TinyGPT(), tmp_path_factory.mktemp("loop"))
    return trace, build_summary(trace)


def test_the_roots_own_loss_is_a_holder_with_its_line(root: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = root
    step = trace.steps[-1]
    check_step(step)
    (held,) = step.memory["outside_modules"]
    assert held["holder"] == "root" and held["model"] == 0
    assert held["site"] == f"test_outside_modules.py:{_line('ROOT_LOSS_LINE', TinyGPT.forward)} (forward)"
    assert held["bytes"] >= LOGITS_F32  # the fp32 log-probabilities the loss keeps for backward
    assert step.modules[0]["activation_self_bytes"][0] == held["bytes"]  # the root's own ops, the same
    (row,) = summary["outside_modules"]
    assert row["name"] == "TinyGPT (own code)" and row["activation_bytes"] == held["bytes"]


def test_the_loops_loss_outside_the_model_is_a_holder_and_in_the_peak(
    loop: tuple[Trace, dict[str, Any]],
) -> None:
    trace = loop[0]
    step = trace.steps[-1]
    (held,) = step.memory["outside_modules"]
    assert held["holder"] == "loop" and held["model"] is None
    assert held["site"] == f"test_outside_modules.py:{_line('LOOP_LINE', _loop_loss)} (_loop_loss)"
    assert held["bytes"] >= 2 * LOGITS_F32  # log-probabilities, and the logits the square keeps
    assert not step.modules[0]["activation_self_bytes"][0]  # no module holds them
    # the accounting's peak sees them: an "outside" sample as backward is about to start
    assert "outside" in step.timeline["event"]
    inside = step.modules[0]["activation_bytes"][0]
    assert step.memory["categories_at_peak"]["activations"] >= inside + held["bytes"]
    assert step.memory["peak_phase"] == "forward"


def test_a_parameterless_loss_module_called_by_the_loop_is_the_loops(tmp_path: Path) -> None:
    trace = _profile(_criterion_loss, TinyGPT(), tmp_path)
    (held,) = trace.steps[-1].memory["outside_modules"]
    assert held["holder"] == "loop" and held["bytes"] >= LOGITS_F32
    assert held["site"].startswith(f"test_outside_modules.py:{_line('CRITERION_LINE', _criterion_loss)} ")


def test_checkpointed_recomputation_and_no_grad_forwards_add_nothing(tmp_path: Path) -> None:
    def step(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            model(idx, y)  # an evaluation: nothing saved
        _, loss = checkpoint(model, idx, y, use_reentrant=False)  # recomputed in backward: not again
        loss.backward()

    trace = _profile(step, TinyGPT(), tmp_path)
    assert sum(h["bytes"] for h in trace.steps[-1].memory["outside_modules"]) < LOGITS_F32


def test_the_plan_notes_it_by_line_and_shrinks_it_with_the_micro_batch(
    loop: tuple[Trace, dict[str, Any]],
) -> None:
    trace, summary = loop
    w = measured_workload(trace, summary)
    assert w is not None and w.outside_bytes == summary["outside_modules"][0]["activation_bytes"] > 0
    assert any("outside every child module" in n and "_loop_loss" in n for n in w.notes)
    # the loop's fp32 loss is never halved by autocast: it counts in the whole, not in the halved share
    assert 0 < w.amp_share < 1
    assert any("checkpointing and offload free none of them" in n for n in w.notes)
    parts = memory_parts(w, Config(accumulation_steps=2), [], [])
    assert parts["activations"] == w.activations // 2


def test_summary_and_top_table_without_the_field_read_as_none() -> None:
    """Traces from before the field: no holders, and the top table is the layers' as it was."""
    builder = TraceBuilder(kind="cuda")
    builder.add_model(bert_like(layers=2))
    builder.add_steps(warmup=0, profiled=1)
    trace = builder.end("completed").build()
    assert outside_holders(trace, trace.steps[-1]) == []
    summary = build_summary(trace)
    assert summary["outside_modules"] == []
    names = [row["name"] for row in biggest_layers(summary, trace, 5)]
    assert "bert.encoder.layer.0" in names


def test_the_top_table_shows_the_roots_own_code_and_the_loop_by_line(
    root: tuple[Trace, dict[str, Any]], loop: tuple[Trace, dict[str, Any]]
) -> None:
    for (trace, summary), expect in ((root, "TinyGPT (own code) at "), (loop, f"{LOOP_HOLDER} at ")):
        top = biggest_layers(summary, trace, 3)
        assert top[0]["name"].startswith(expect)  # the largest holder of this model: the loss
        assert top[0]["activation_bytes"] == summary["outside_modules"][0]["activation_bytes"]
        assert not any(row["name"].endswith("(own)") and "TinyGPT" in row["name"] for row in top)


def test_the_peak_ledgers_temporaries_join_their_line() -> None:
    builder = TraceBuilder(kind="cuda")
    builder.add_model(bert_like(layers=1))
    builder.add_steps(warmup=0, profiled=1)
    trace = builder.end("completed").build()
    step = trace.steps[-1]
    step.memory["outside_modules"] = [
        {"holder": "root", "model": 0, "site": "gpt.py:120 (forward)", "bytes": 100},
        {"holder": "loop", "model": None, "site": "train.py:40 (main)", "bytes": 50},
    ]
    step.memory["peak_ledger"] = {
        "categories": {"temporaries": 3000},
        "temporaries_by_site": [
            ["functional.py:3000 (cross_entropy) <- train.py:40 (main)", 2000],
            ["gpt.py:120 (forward)", 1000],
            ["elsewhere.py:1 (f)", 7],
        ],
    }
    check_step(step)
    rows = outside_holders(trace, step)
    assert [(r["holder"], r["temporary_bytes"]) for r in rows] == [("loop", 2000), ("root", 1000)]


@pytest.mark.parametrize(
    "bad",
    [
        [{"holder": "elsewhere", "model": None, "site": "x.py:1 (f)", "bytes": 1}],
        [{"holder": "loop", "model": None, "site": "x.py:1 (f)", "bytes": -1}],
        "x",
    ],
)
def test_the_trace_check_refuses_a_bad_outside_modules(bad: Any) -> None:
    builder = TraceBuilder(kind="cpu")
    builder.add_model(bert_like(layers=1))
    builder.add_steps(warmup=0, profiled=1)
    step = builder.end("completed").build().steps[-1]
    step.memory["outside_modules"] = bad
    with pytest.raises(ValueError, match="outside_modules"):
        check_step(step)
