"""The re-profile of last resort, where no micro-batch split applies: every repeated block checkpointed
at the full batch, its forwards measured as if not checkpointed (``SeeThrough``), and the script's own
step rebuilt from that run (``memdoctor.plan.checkpointed``). In-process sessions on a tiny model, the
loop with a fake runner, and one real end-to-end run on CPU with an emulated out-of-memory error."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from test_reprofile import FakeRunner, _first, _request, _with_loop
from torch import nn
from tracebuilder import trace_from_records

from memdoctor import exitcodes
from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import peak_step
from memdoctor.capture.session import ProfileSession
from memdoctor.cli import main
from memdoctor.launch.reprofile import reprofile
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult
from memdoctor.levers.apply import SeeThrough, checkpoint_module
from memdoctor.levers.install import SEEN_THROUGH, install
from memdoctor.plan.checkpointed import blocks_to_checkpoint, checkpointed_workload
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.model import predict, workload
from memdoctor.plan.reprofiled import RECORD_NAME, from_record, unmeasured_modules
from memdoctor.report import build_summary
from memdoctor.trace import Trace, load_trace

MiB = 2**20
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))  # saves fc1's input and tanh's output (1 MiB)


class Net(nn.Module):
    """Returns logits; the loop computes the loss: no split in the forward."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# ----------------------------------------------------------------------------------------- the lever


def test_see_through_shows_what_the_unchecked_forward_saves_and_keeps_none_of_it() -> None:
    torch.manual_seed(0)
    block, x = Block(8), torch.randn(16, 8, requires_grad=True)
    plain: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t.numel()) or t, lambda t: t):
        block(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    seen: list[weakref.ref[torch.Tensor]] = []
    undo = checkpoint_module(block, lambda t: seen.append(weakref.ref(t)))
    try:
        out = block(x)
        gc.collect()
        assert len(seen) == len(plain) - 1  # every save of the block's ops (the loss's square is outside)
        assert any(r() is None for r in seen)  # tanh's output, freed at the block's exit: not kept
        out.square().sum().backward()
    finally:
        undo()
    assert torch.equal(x.grad, want)  # the same gradients: the checkpoint still recomputes


def test_see_through_is_not_used_without_a_consumer() -> None:
    assert issubclass(SeeThrough, torch.autograd.graph.saved_tensors_hooks)
    block, x = Block(4), torch.randn(2, 4, requires_grad=True)
    undo = checkpoint_module(block)
    try:
        block(x).sum().backward()  # plain checkpointing still works
    finally:
        undo()
    assert x.grad is not None


# ----------------------------------------------------------------------------------------- the merge


def _profiled(
    tmp_path: Path, name: str, checkpointed: bool, time_depth: int | None = None
) -> tuple[Trace, dict[str, Any]]:
    """Two steps of the tiny get_batch() loop under a session, every block checkpointed and seen
    through when ``checkpointed``."""
    torch.manual_seed(0)
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=1, warmup=1, sink=records.append, time_depth=time_depth)
    inst = None
    if checkpointed:
        inst = install(
            {"memdoctor_config": 1, "checkpoint": BLOCKS}, say=lambda _: None, see_saved=session.see_saved
        )
    try:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with session:
            for _ in range(2):
                x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        if inst is not None:
            inst.remove()
    trace = trace_from_records(tmp_path / f"{name}.jsonl.gz", records)
    return trace, build_summary(trace)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Trace, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("ckall")
    return {"plain": _profiled(tmp, "plain", False), "checkpointed": _profiled(tmp, "ckpt", True)}


def test_every_repeated_block_is_chosen(runs: dict[str, tuple[Trace, dict[str, Any]]]) -> None:
    info, blocks = blocks_to_checkpoint(runs["plain"][0])
    assert info is not None and info.cls == "Net" and blocks == BLOCKS  # not their Linear leaves


def test_the_checkpointed_run_measures_each_block_as_the_script_holds_it(
    runs: dict[str, tuple[Trace, dict[str, Any]]],
) -> None:
    """Tensor accounting on a CPU is exact, so the rebuilt step equals the unchecked one to the byte;
    the checkpointed run itself held 4 MiB less."""
    plain, ckpt = runs["plain"], runs["checkpointed"]
    truth = measured_workload(*plain)
    assert truth is not None
    assert ckpt[1]["peak_memory_bytes"] <= truth.peak_bytes - 3 * MiB  # it did checkpoint
    w = checkpointed_workload(ckpt[0], ckpt[1], BLOCKS, oom_budget=8 * MiB)
    assert w is not None
    assert {c.name: c.free_bytes for c in w.candidates} == {c.name: c.free_bytes for c in truth.candidates}
    assert [c.free_bytes for c in w.candidates] == [MiB] * 4
    assert w.peak_bytes == truth.peak_bytes and w.activations == truth.activations
    assert w.parameters == truth.parameters and w.as_is_oom_budget == 8 * MiB
    assert predict(w, Config()).peak_bytes == predict(truth, Config()).peak_bytes
    assert "4 blocks checkpointed at the full batch" in w.notes[-1]


def test_untimed_blocks_are_held_whole_from_the_forward_end(
    runs: dict[str, tuple[Trace, dict[str, Any]]], tmp_path: Path
) -> None:
    """Blocks called deeper than the timing depth have no samples and no ``checkpoint_free_bytes``: each
    is taken as held whole (its input too) from the model's forward end: an upper bound, by at most the
    blocks' inputs (4 x 256 KiB)."""
    truth = measured_workload(*runs["plain"])
    trace, summary = _profiled(tmp_path, "untimed", True, time_depth=0)
    assert {r["checkpoint_free_bytes"] for r in layer_table(trace, peak_step(trace)) if r["depth"] == 2} == {
        None
    }
    w = checkpointed_workload(trace, summary, BLOCKS, oom_budget=None)
    assert truth is not None and w is not None
    assert truth.peak_bytes <= w.peak_bytes <= truth.peak_bytes + 4 * 256 * 1024


def test_without_seeing_through_a_checkpointed_block_holds_only_its_input(
    runs: dict[str, tuple[Trace, dict[str, Any]]], tmp_path: Path
) -> None:
    """Why SeeThrough is needed: the ledger's own hook is not called under a checkpoint."""
    torch.manual_seed(0)
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=1, warmup=0, sink=records.append)
    model = Net()
    undo = [checkpoint_module(model.get_submodule(n)) for n in BLOCKS]
    with session:
        nn.functional.cross_entropy(model(torch.randn(512, 16)), torch.randint(0, 4, (512,))).backward()
        torch.optim.SGD(model.parameters(), lr=0.01).step()
    for u in undo:
        u()
    trace = trace_from_records(tmp_path / "hidden.jsonl.gz", records)
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.candidates == []  # nothing a block saves is seen: nothing to free


# ----------------------------------------------------------------------------------------- the loop


def _seen(trace: Trace) -> Trace:
    trace.events.append({"kind": "config_applied", "message": f"checkpointing 12 modules; {SEEN_THROUGH}"})
    return trace


NO_SPLIT = {
    "loss": {"in_forward": False, "at": None, "why": "the loop computes it"},
    "loader": False,
    "torch_optim": True,
    "knobs": None,
}


def test_where_no_split_applies_every_block_is_checkpointed_at_the_full_batch(tmp_path: Path) -> None:
    from test_reprofile import GPT2_B8

    trace, summary = _first()
    _with_loop(trace, NO_SPLIT)
    runner = FakeRunner([(exitcodes.OK, _seen(load_trace(GPT2_B8)))])
    lines: list[str] = []
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    (req,) = runner.requests
    assert req.see_checkpointed and req.steps == 1 and req.out_dir == tmp_path / "reprofile"
    assert req.time_depth == 3  # transformer.h.N timed, whatever depth the first run picked
    assert req.config is not None and req.config["accumulation_steps"] == 1
    assert req.config["checkpoint"] == [f"transformer.h.{i}" for i in range(12)]
    assert req.config["provenance"]["model_class"] == "GPT2LMHeadModel"
    assert record["method"] == "checkpoint" and record["used_round"] == 1 and record["stopped"] is None
    assert "no safe micro-batch split" in record["why_no_split"]
    w = from_record(record["workload"])
    assert w.split.kind is None and w.as_is_oom_budget == 8 * 2**30  # the plan proposes no micro-batching
    assert any("every repeated block checkpointed (12: " in line for line in lines)
    trace.collected[RECORD_NAME] = record
    after = build_summary(trace)
    rp = after["reprofile"]
    assert rp["method"] == "checkpoint" and rp["checkpointed"][0] == "transformer.h.0"
    assert rp["planned_from_reprofile"] and rp["rounds"][0]["checkpointed"] == 12
    advice = after["plan"]["advice"][0]
    assert "no safe micro-batch split" in advice and "with every repeated block checkpointed (12: " in advice
    assert workload(trace, summary).split.kind is None


def test_a_refused_split_gives_way_to_checkpointing(tmp_path: Path) -> None:
    from test_reprofile import GPT2_B8, GPT2_OOM

    trace, summary = _first()
    _with_loop(trace, {**NO_SPLIT, "loss": None})  # died before its loss: the forward split is tried
    refused = "the plan could not be applied: accumulation_steps: the model's forward returns no loss, so x"
    runner = FakeRunner(
        [(exitcodes.USAGE_ERROR, load_trace(GPT2_OOM)), (exitcodes.OK, _seen(load_trace(GPT2_B8)))]
    )
    messages = iter([refused, "ok"])

    def call(req: ProfileRequest) -> ProfileResult:
        return dataclasses.replace(runner(req), message=next(messages))

    record = reprofile(trace, summary, _request(tmp_path), call, lambda _: None, max_rounds=3)
    assert [r["split"] for r in record["rounds"]] == ["forward", None]
    assert record["why_no_split"] == (
        "no micro-batch split applies: the forward split was refused (accumulation_steps: the model's "
        "forward returns no loss)"
    )
    assert record["used_round"] == 2 and runner.requests[1].out_dir == tmp_path / "reprofile-2"


@pytest.mark.parametrize("code", [exitcodes.OUT_OF_MEMORY, exitcodes.OK])
def test_a_checkpointed_round_that_still_dies_or_saw_nothing_is_not_retried(
    code: int, tmp_path: Path
) -> None:
    from test_reprofile import GPT2_B8, GPT2_OOM

    trace, summary = _first()
    _with_loop(trace, NO_SPLIT)
    second = load_trace(GPT2_OOM) if code == exitcodes.OUT_OF_MEMORY else load_trace(GPT2_B8)  # not seen
    runner = FakeRunner([(code, second)] * 3)
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=3)
    assert len(runner.requests) == 1 and record["workload"] is None
    said = "not retried" if code == exitcodes.OUT_OF_MEMORY else "could not measure the blocks' own"
    assert said in record["stopped"] and record["stopped"].startswith("no safe micro-batch split")
    trace.collected[RECORD_NAME] = record
    assert "every prediction is a lower bound" in build_summary(trace)["plan"]["advice"][0]


def test_no_checkpointed_round_without_blocks_or_rounds(tmp_path: Path) -> None:
    trace, summary = _first()
    _with_loop(trace, NO_SPLIT)
    runner = FakeRunner([])
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=0)
    assert runner.requests == [] and "no round left" in record["stopped"]
    trace.models[0].parents[:] = [-1] + [0] * (len(trace.models[0].parents) - 1)  # a flat model: no blocks
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=3)
    assert runner.requests == [] and "no repeated blocks to checkpoint" in record["stopped"]


# ----------------------------------------------------------------------------------------- end to end


NO_SPLIT_LOOP = """
import os
import weakref

import torch
from torch import nn

torch.manual_seed(0)
CAP = int(os.environ.get("EMULATED_CAP_BYTES", "0"))
HELD = {}  # id -> weak reference of each block's hidden activation


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        HELD[id(h)] = weakref.ref(h)
        return x + self.fc2(h)


class Head(nn.Linear):
    def forward(self, x):
        alive = [t for t in (r() for r in HELD.values()) if t is not None]
        HELD.clear()
        HELD.update((id(t), weakref.ref(t)) for t in alive)
        held = sum(t.nbytes for t in alive)
        if CAP and held > CAP:  # emulates a GPU out of memory: the blocks' activations held
            raise torch.OutOfMemoryError(f"CUDA out of memory (emulated: {held} bytes held by blocks)")
        return super().forward(x)


class Net(nn.Module):  # returns logits: the loop computes the loss
    def __init__(self, d=128):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.head = Head(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def get_batch():  # no DataLoader, no batch-size or accumulation argument: no split applies
    return torch.randn(1024, 16), torch.randint(0, 4, (1024,))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
for _ in range(4):
    x, y = get_batch()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_profile_falls_back_to_checkpointing_every_block_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real supervisor on a get_batch() loop whose head 'runs out of memory' while the blocks hold
    more than 4 MiB of activations (8 MiB at the full batch; none with every block checkpointed). The
    plan made from the merge is compared with an unconstrained profile of the same script: on a CPU the
    tensor accounting counts every saved byte, so the rebuilt peak must match it to 1% (the margin is
    for the loss's few bytes and the random batch's labels, the only things that differ)."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(NO_SPLIT_LOOP)
    common = ["profile", "--warmup", "0", "--steps", "1"]
    assert main([*common, "-o", "truth", "loop.py"]) == exitcodes.OK  # no cap: the truth
    truth = json.loads((tmp_path / "truth" / "summary.json").read_text())
    monkeypatch.setenv("EMULATED_CAP_BYTES", str(4 * MiB))
    assert main([*common, "--budget", "12MiB", "-o", "out", "loop.py"]) == exitcodes.OUT_OF_MEMORY
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    rp = summary["reprofile"]
    assert rp["unmeasured_modules"] == ["head"] and rp["method"] == "checkpoint"
    assert rp["checkpointed"] == BLOCKS and rp["planned_from_reprofile"]
    assert "forward split was refused" in rp["why_no_split"]  # it died before its loss: forward tried
    used = rp["rounds"][rp["used_round"] - 1]
    assert used["checkpointed"] == 4 and used["status"] == "completed"
    second = load_trace(out / used["trace"])
    assert second.header["applied_config"]["checkpoint"] == BLOCKS
    assert unmeasured_modules(second) == [] and second.end is not None
    assert any(SEEN_THROUGH in str(e.get("message")) for e in second.events)  # memdoctor run's line
    assert "every repeated block checkpointed (4: blocks.0" in capsys.readouterr().err
    first = load_trace(out / "trace.jsonl.gz")
    w = workload(first, summary)
    truth_peak = truth["peak_memory_bytes"]
    assert abs(w.peak_bytes - truth_peak) <= 0.01 * truth_peak
    assert [c.free_bytes for c in w.candidates] == [2 * MiB] * 4
    plan = summary["plan"]
    assert plan["fits"] and not plan["fits_as_is"] and plan["config"]["checkpoint"]
    assert plan["config"]["accumulation_steps"] == 1  # no split applies: no micro-batching planned
    assert "every repeated block checkpointed" in plan["advice"][0]
    # the plan's checkpointing, predicted from the merge and by the same planner from the unchecked
    # profile (only its checkpoint set: which parameters it offloads depends on measured times, noise)
    chosen = Config(checkpoint=tuple(plan["config"]["checkpoint"]))
    truth_trace = load_trace(tmp_path / "truth" / "trace.jsonl.gz")
    truth_w = measured_workload(truth_trace, truth)
    assert truth_w is not None
    predicted, expected = predict(w, chosen).peak_bytes, predict(truth_w, chosen).peak_bytes
    assert abs(predicted - expected) <= 0.01 * expected
