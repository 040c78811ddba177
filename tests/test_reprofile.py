"""Re-profiling at a smaller micro-batch a run that died before its forward finished: which runs need
it, the loop (with a fake profile runner), planning from it, the record in the trace and summary.json,
and one real end-to-end run on CPU with an emulated out-of-memory error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memdoctor import exitcodes
from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import peak_step
from memdoctor.cli import main, parse_args
from memdoctor.cli.terminal import say
from memdoctor.launch.reprofile import needed, reprofile
from memdoctor.launch.rounds import reprofile_profile
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.model import workload
from memdoctor.plan.planner import make_plan
from memdoctor.plan.reprofiled import (
    RECORD_NAME,
    as_record,
    from_record,
    full_batch,
    reprofiled_workload,
    unmeasured_modules,
)
from memdoctor.plan.target import Target, known_oom
from memdoctor.report import build_summary
from memdoctor.trace import Trace, load_trace, save_trace

GiB = 1024**3
DATA = Path(__file__).parent / "data"
# GPT-2 small b16 s512 in the HF Trainer under an 8 GiB cap on the H200: out of memory in block 10 of 12,
# so block 11, the final norm and the LM head never ran; and the same script at b8 without a cap.
GPT2_OOM = DATA / "gpu-gpt2-small-trainer-b16-s512-8gib-oom.jsonl.gz"
GPT2_B8 = DATA / "gpu-gpt2-small-trainer-b8-s512.jsonl.gz"


@pytest.fixture(scope="module")
def gpt2_b8() -> tuple[Trace, dict[str, Any]]:
    trace = load_trace(GPT2_B8)
    return trace, build_summary(trace)


def _first() -> tuple[Trace, dict[str, Any]]:
    trace = load_trace(GPT2_OOM)
    return trace, build_summary(trace)


class FakeRunner:
    """Stands in for ``run_profile``: each call saves the next of ``outcomes`` ((exit code, trace))."""

    def __init__(self, outcomes: list[tuple[int, Trace]]) -> None:
        self.outcomes = outcomes
        self.requests: list[ProfileRequest] = []

    def __call__(self, req: ProfileRequest) -> ProfileResult:
        self.requests.append(req)
        code, trace = self.outcomes[len(self.requests) - 1]
        path = save_trace(trace, req.out_dir / "trace.jsonl.gz")
        status = {exitcodes.OK: "completed", exitcodes.OUT_OF_MEMORY: "oom"}.get(code, "exception")
        return ProfileResult(code, status, f"fake {status}", trace_path=path, summary=build_summary(trace))


def _request(out: Path) -> ProfileRequest:
    return ProfileRequest(script="train.py", module=None, args=[], out_dir=out, budget_bytes=8 * GiB)


def _oom(first: Trace) -> ProfileResult:
    return ProfileResult(exitcodes.OUT_OF_MEMORY, "oom", "died", trace_path=None, summary={})


# ----------------------------------------------------------------------------------------- when


def test_a_run_that_died_in_its_forward_names_what_it_never_measured() -> None:
    trace, _ = _first()
    missing = unmeasured_modules(trace)
    # the tied LM head holds no bytes of its own in the ledger, and is still named: it holds a weight
    assert missing[-2:] == ["transformer.ln_f", "lm_head"]
    assert "transformer.h.11.mlp.c_fc" in missing and "transformer.h.10.attn.c_attn" not in missing
    reason = needed(trace, _oom(trace))
    assert reason is not None and "never measured: transformer.h.11.ln_1," in reason


def test_runs_that_need_no_reprofile(gpt2_b8: tuple[Trace, dict[str, Any]]) -> None:
    assert unmeasured_modules(gpt2_b8[0]) == []  # it completed
    trace, _ = _first()
    ok = ProfileResult(exitcodes.OK, "completed", "ok")
    assert needed(trace, ok) is None  # only an out-of-memory run
    trace.header["applied_config"] = {"accumulation_steps": 2}
    assert needed(trace, _oom(trace)) is None  # profile --config: not the script as it is
    assert needed(gpt2_b8[0], _oom(gpt2_b8[0])) is None  # out of memory with every step finished
    trace, _ = _first()
    trace.steps[-1].phases_ms["backward"] = 12.0  # it reached its backward: every module that runs ran
    assert unmeasured_modules(trace) == []


def _died_after_every_module(phase: str, module: int | None) -> Trace:
    """GPT-2 b8 cut short in its last step after every module had run: out of memory in ``phase``
    (in ``module``'s own code, or in none: the loop's)."""
    trace = load_trace(GPT2_B8)
    trace.steps[-1].complete = False
    trace.end = {"status": "oom", "message": "CUDA out of memory", "exit_code": 1}
    event = {"kind": "oom", "message": "CUDA out of memory", "step": trace.steps[-1].step, "phase": phase}
    trace.events.append({**event, "model": 0 if module is not None else None, "module": module})
    return trace


@pytest.mark.parametrize(
    ("phase", "module", "said"),
    [
        ("forward", 0, "its forward, in (GPT2LMHeadModel)"),  # the root's own code: its logits upcast
        ("forward", None, "the run died in its forward,"),  # the loop's loss, outside the model
        ("backward", None, "its backward"),
        ("optimizer", None, "its optimizer step"),
    ],
)
def test_a_run_that_died_after_every_module_ran_is_reprofiled_too(
    phase: str, module: int | None, said: str
) -> None:
    """Every module ran, so none is unmeasured; the step's peak never was: re-profile."""
    trace = _died_after_every_module(phase, module)
    assert unmeasured_modules(trace) == []
    reason = needed(trace, _oom(trace))
    assert reason is not None and said in reason and "never finished" in reason


def test_a_reprofile_after_every_module_ran_halves_until_a_step_completes(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    """A round that measured every module but ran out of memory again (further on, in its backward) is
    not planned from (its peak is unmeasured too), nor does "got no further" stop the halving: no module
    was missing to begin with."""
    trace = _died_after_every_module("forward", 0)
    summary = build_summary(trace)
    again = _died_after_every_module("backward", None)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, again), (exitcodes.OK, gpt2_b8[0])])
    lines: list[str] = []
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert [r["measured_every_module"] for r in record["rounds"]] == [False, True]
    assert record["used_round"] == 2 and record["accumulation_steps"] == 4 and record["stopped"] is None
    assert "never finished" in lines[0]
    trace.collected[RECORD_NAME] = record
    assert "after every module had run" in build_summary(trace)["plan"]["advice"][0]


def test_a_round_that_dies_where_the_run_before_it_did_at_the_same_peak_stops_the_halving(
    tmp_path: Path,
) -> None:
    """What runs out of memory did not shrink with the batch: no second round at 1/4, and the record says
    why; a round that died in the same place at a clearly lower peak goes on (the next one, at that peak
    again, stops)."""
    trace = _died_after_every_module("optimizer", None)
    summary = build_summary(trace)
    same = _died_after_every_module("optimizer", None)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, same)] * 3)
    lines: list[str] = []
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert len(runner.requests) == 1 and record["workload"] is None
    assert "died again in its optimizer step at the same peak" in record["stopped"]
    assert "does not shrink with the batch" in lines[-1]
    lower = _died_after_every_module("optimizer", None)
    for s in lower.steps:
        s.memory["peak_bytes"] = int(s.memory["peak_bytes"] * 0.8)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, lower)] * 3)
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert len(runner.requests) == 2 and "at the same peak" in record["stopped"]
    # Died "in the same place" at a clearly higher peak: it got further (the minimal GPT on the H200:
    # its root's upcast at 5.78 GiB, then at 1/2 in the first backward at 7.67 GiB): halving goes on.
    higher = _died_after_every_module("optimizer", None)
    for s in higher.steps:
        s.memory["peak_bytes"] = int(s.memory["peak_bytes"] * 1.3)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, higher)] * 3)
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert [r.config["accumulation_steps"] for r in runner.requests if r.config] == [2, 4]
    assert "at the same peak" in record["stopped"]  # the second higher round: where the first died


# ----------------------------------------------------------------------------------------- the loop


def test_the_first_micro_batch_that_measures_everything_is_planned_from(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, summary = _first()
    runner = FakeRunner([(exitcodes.OK, gpt2_b8[0])])
    lines: list[str] = []
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    (req,) = runner.requests
    assert req.config is not None and req.config["accumulation_steps"] == 2 and req.config["micro_batch"] == 8
    assert req.out_dir == tmp_path / "reprofile" and req.steps == 1 and req.budget_bytes == 8 * GiB
    assert record["used_round"] == 1 and record["accumulation_steps"] == 2 and record["stopped"] is None
    assert any("planning from micro-batch 1/2" in line for line in lines)
    measured = measured_workload(*gpt2_b8)
    planned = from_record(record["workload"])
    assert measured is not None
    assert planned.activations == 2 * measured.activations
    assert planned.temporaries == 2 * measured.temporaries
    assert planned.parameters == measured.parameters and planned.optimizer_state == measured.optimizer_state
    assert planned.batch_size == 16 and planned.as_is_oom_budget == 8 * GiB


def test_halving_goes_on_while_the_forward_gets_further_and_stops_when_it_does_not(tmp_path: Path) -> None:
    trace, summary = _first()
    stuck = load_trace(GPT2_OOM)  # the same place again: the memory does not shrink with the batch
    lines: list[str] = []
    record = reprofile(
        trace,
        summary,
        _request(tmp_path),
        FakeRunner([(exitcodes.OUT_OF_MEMORY, stuck)] * 3),
        lines.append,
        max_rounds=3,
    )
    assert len(record["rounds"]) == 1 and record["workload"] is None
    assert "got no further" in record["stopped"]
    further = load_trace(GPT2_OOM)
    for s in further.steps:  # block 11 ran this time; the final norm and the head still did not
        for col in s.modules.values():
            for i, name in enumerate(further.models[0].names):
                if name.startswith("transformer.h.11"):
                    col["calls"][i] = 1
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, further), (exitcodes.OUT_OF_MEMORY, further)])
    record = reprofile(trace, summary, _request(tmp_path), runner, lines.append, max_rounds=3)
    assert [r["unmeasured_modules"] for r in record["rounds"]] == [2, 2]
    assert [r.config["accumulation_steps"] for r in runner.requests if r.config] == [2, 4]
    assert runner.requests[1].out_dir == tmp_path / "reprofile-2"


def test_a_failed_reprofile_or_a_micro_batch_of_one_stops(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, summary = _first()
    record = reprofile(trace, summary, _request(tmp_path), FakeRunner([(1, gpt2_b8[0])]), print, max_rounds=3)
    assert record["stopped"].startswith("the re-profiled run failed") and record["workload"] is None
    summary["data"]["largest_batch"]["shapes"] = {"input_ids": [2, 512]}  # a batch of 2: only 1/2 is possible
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, _stepped(load_trace(GPT2_OOM)))] * 2)
    record = reprofile(trace, summary, _request(tmp_path), runner, print, max_rounds=3)
    assert len(runner.requests) == 1 and "micro-batch of 1" in record["stopped"]


def _stepped(trace: Trace) -> Trace:
    """``trace`` with one module fewer unmeasured (progress, so that the loop would go on)."""
    for s in trace.steps:
        for col in s.modules.values():
            col["calls"][trace.models[0].names.index("lm_head")] = 1
    return trace


# ----------------------------------------------------------------------------------------- planning


def test_the_plan_comes_from_the_reprofile_and_says_so(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, summary = _first()
    lower_bound = summary["plan"]
    record = reprofile(
        trace, summary, _request(tmp_path), FakeRunner([(exitcodes.OK, gpt2_b8[0])]), print, max_rounds=3
    )
    trace.collected[RECORD_NAME] = record
    after = build_summary(trace)
    plan = after["plan"]
    assert plan["fits"] and not plan["fits_as_is"]
    # the head's logits and the loss now count: the lower-bound plan (bf16 alone) predicted less
    assert (
        plan["prediction"]["breakdown"]["temporaries"] > lower_bound["prediction"]["breakdown"]["temporaries"]
    )
    assert plan["levers"] != lower_bound["levers"]
    assert "re-profiled it at micro-batch 1/2 (reprofile/trace.jsonl.gz)" in plan["advice"][0]
    assert any(
        "planned from a re-profile at micro-batch 1/2 (8 of 16)" in a
        for a in plan["prediction"]["assumptions"]
    )
    rp = after["reprofile"]
    assert rp["planned_from_reprofile"] and rp["used_round"] == 1 and rp["rounds"][0]["micro_batch"] == 8
    assert "lm_head" in rp["unmeasured_modules"]
    assert build_summary(load_trace(GPT2_OOM))["reprofile"] is None


def test_the_script_as_it_is_never_fits_the_budget_it_died_under(
    gpt2_b8: tuple[Trace, dict[str, Any]],
) -> None:
    w = measured_workload(*gpt2_b8)
    assert w is not None
    big = Target(80 * GiB)
    scaled = full_batch(w, 2, 16, oom_budget=40 * GiB)
    assert make_plan(scaled, big).fits_as_is  # a larger card than the one it died on: as predicted
    scaled = full_batch(w, 2, 16, oom_budget=80 * GiB)
    assert known_oom(scaled, Config(), big) and not known_oom(scaled, Config(precision="bf16"), big)
    plan = make_plan(scaled, big)
    assert not plan.fits_as_is and plan.chosen is not None and plan.chosen.config != Config()


def test_the_record_round_trips_and_a_hostile_one_is_ignored(gpt2_b8: tuple[Trace, dict[str, Any]]) -> None:
    w = measured_workload(*gpt2_b8)
    assert w is not None and w.candidates
    scaled = full_batch(w, 4, 32, 8 * GiB)
    assert from_record(json.loads(json.dumps(as_record(scaled)))) == scaled
    trace, summary = _first()
    for hostile in (
        {"workload": {"peak_bytes": 1}},
        {"workload": "x"},
        "x",
        {"workload": {**as_record(scaled), "candidates": [{}]}},
    ):
        trace.collected[RECORD_NAME] = hostile  # type: ignore[assignment]
        assert reprofiled_workload(trace) is None
        assert workload(trace, summary) == measured_workload(trace, summary)
    trace.collected[RECORD_NAME] = {"rounds": "x", "unmeasured_modules": 3, "used_round": True}
    assert build_summary(trace)["reprofile"]["rounds"] == []


# ----------------------------------------------------------------------------------------- the command


def test_reprofile_option() -> None:
    assert parse_args(["profile", "x.py"]).reprofile == 3
    assert parse_args(["profile", "--reprofile", "0", "x.py"]).reprofile == 0


def test_the_command_records_in_the_first_trace_and_re_renders(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, summary = _first()
    path = save_trace(trace, tmp_path / "trace.jsonl.gz")
    result = ProfileResult(exitcodes.OUT_OF_MEMORY, "oom", "died", trace_path=path, summary=summary)
    result, written = reprofile_profile(
        _request(tmp_path), result, 3, FakeRunner([(exitcodes.OK, gpt2_b8[0])]), say
    )
    assert tmp_path / "reprofile" / "trace.jsonl.gz" in written
    assert result.exit_code == exitcodes.OUT_OF_MEMORY  # the first run's
    assert result.summary["reprofile"]["planned_from_reprofile"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["plan"] == result.summary["plan"] and "re-profiled" in on_disk["plan"]["advice"][0]
    assert "re-profiled it at micro-batch 1/2" in (tmp_path / "report.html").read_text()
    assert "accumulation_steps: 2" in (tmp_path / "memdoctor.yaml").read_text()
    assert load_trace(path).collected[RECORD_NAME]["used_round"] == 1


OOM_LOOP = """
import torch

torch.manual_seed(0)
nn = torch.nn


class Head(nn.Linear):
    def forward(self, x):
        if x.shape[0] > 256:  # emulates a GPU out of memory at the head at the full batch only
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated)")
        return super().forward(x)


class Net(nn.Module):  # computes its own loss, as memdoctor's micro-batching needs
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
        self.head = Head(256, 2)

    def forward(self, x):
        return self.head(self.body(x)).square().mean()


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4096, 32)), batch_size=512)
for (x,) in loader:
    model(x).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_profile_reprofiles_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real supervisor on a tiny CPU loop whose head 'runs out of memory' at the full batch."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(OOM_LOOP)
    argv = ["profile", "--warmup", "0", "--steps", "2", "--budget", "4MiB", "-o", "out", "loop.py"]
    assert main(argv) == exitcodes.OUT_OF_MEMORY
    out = tmp_path / "out"
    rp = json.loads((out / "summary.json").read_text())["reprofile"]
    assert rp["unmeasured_modules"] == ["head"] and rp["batch_size"] == 512
    assert (
        rp["planned_from_reprofile"]
        and rp["accumulation_steps"] == 2
        and rp["rounds"][0]["micro_batch"] == 256
    )
    second = load_trace(out / "reprofile" / "trace.jsonl.gz")
    assert second.header["applied_config"]["accumulation_steps"] == 2 and second.end is not None
    assert unmeasured_modules(second) == []
    assert "reprofile 1: measured every module" in capsys.readouterr().err
    assert "(--reprofile 0)" not in (out / "report.html").read_text()
    assert main([*argv[:-3], "--reprofile", "0", "-o", "out2", "loop.py"]) == exitcodes.OUT_OF_MEMORY
    assert json.loads((tmp_path / "out2" / "summary.json").read_text())["reprofile"] is None
    assert not (tmp_path / "out2" / "reprofile").exists()


# ----------------------------------------------------------------------------------------- which split


def _with_loop(trace: Trace, loop: dict[str, Any]) -> Trace:
    trace.collected["data"] = {**(trace.collected.get("data") or {}), "loop": loop}
    return trace


def test_a_split_that_does_not_apply_gives_way_to_the_next_at_the_same_micro_batch(
    gpt2_b8: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, summary = _first()
    _with_loop(
        trace, {"loss": None, "loader": True, "torch_optim": False, "knobs": None}
    )  # died before its loss
    runner = FakeRunner([(exitcodes.USAGE_ERROR, load_trace(GPT2_OOM)), (exitcodes.OK, gpt2_b8[0])])
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=3)
    first, second = (r.config or {} for r in runner.requests)
    assert first["accumulation_split"] == "forward" and second["accumulation_split"] == "loader"
    assert first["accumulation_steps"] == second["accumulation_steps"] == 2
    assert record["used_round"] == 2 and [r["split"] for r in record["rounds"]] == ["forward", "loader"]
    assert from_record(record["workload"]).split.kind == "loader"


def test_no_micro_batch_reprofile_where_no_split_applies_and_the_record_says_why(tmp_path: Path) -> None:
    """The one round is the checkpointed one (tests/test_reprofile_checkpoint.py); here it dies again."""
    trace, summary = _first()
    outside = {"in_forward": False, "at": None, "why": "the loop computes it"}
    _with_loop(trace, {"loss": outside, "loader": False, "torch_optim": True, "knobs": None})
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, load_trace(GPT2_OOM))])
    record = reprofile(trace, summary, _request(tmp_path), runner, lambda _: None, max_rounds=3)
    (req,) = runner.requests
    assert req.config is not None and req.config["accumulation_steps"] == 1 and req.see_checkpointed
    assert record["rounds"][0]["split"] is None and record["workload"] is None
    assert "not come from a DataLoader" in record["why_no_split"]
    assert (
        "no safe micro-batch split" in record["stopped"] and "not come from a DataLoader" in record["stopped"]
    )


def test_the_planner_proposes_micro_batching_only_where_a_split_applies() -> None:
    from memdoctor.plan.tiers import accumulations

    outside = {"in_forward": False, "at": None, "why": "the loop computes it"}
    trace = _with_loop(
        load_trace(GPT2_B8), {"loss": outside, "loader": False, "torch_optim": True, "knobs": None}
    )
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.split.kind is None and accumulations(w) == [1]
    assert any(n.startswith("no safe micro-batch split: the loop computes it") for n in w.notes)
    trace = _with_loop(
        load_trace(GPT2_B8), {"loss": outside, "loader": True, "torch_optim": True, "knobs": None}
    )
    assert trace.collected["data"]["lookahead"] == 1  # the HF Trainer reads one batch ahead: followed
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.split.kind == "loader" and accumulations(w) == [1, 2, 4, 8]
    trace.collected["data"]["lookahead"] = 2
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.split.kind is None and "2 batches ahead" in (w.split.why_not or "")
    trace.collected["data"]["lookahead"] = 0
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.split.kind == "loader" and accumulations(w) == [1, 2, 4, 8]


SPLIT_LOOP = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return {"loss": nn.functional.mse_loss(self.head(x).squeeze(-1), y)}


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    loss = model(torch.randn(64, 32, 64), torch.randn(64, 32))["loss"]  # blocks free > 1 MiB: candidates
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_a_forward_split_measures_each_module_over_all_its_micro_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profiled with the batch split in two inside the forward, each block reports the whole batch's
    checkpoint_free_bytes (2 calls, 1 micro-batch) on this CPU loop. The re-profile still takes them x k
    (``full_batch``): on the H200 the BERT story's plan was predicted within +2.2% that way and over-
    predicted by 10% taken as measured (BENCHMARKS.md): a contradiction left open."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(SPLIT_LOOP)
    Path("mb.yaml").write_text("memdoctor_config: 1\naccumulation_steps: 2\naccumulation_split: forward\n")
    base = ["profile", "--warmup", "0", "--steps", "2"]
    assert main([*base, "-o", "full", "loop.py"]) == exitcodes.OK
    assert main([*base, "--config", "mb.yaml", "-o", "split", "loop.py"]) == exitcodes.OK
    rows = {}
    for name in ("full", "split"):
        trace = load_trace(Path(name) / "trace.jsonl.gz")
        step = peak_step(trace)
        assert step is not None and step.micro_batches == 1
        rows[name] = {r["name"]: r for r in layer_table(trace, step)}
    full, split = rows["full"]["blocks.0"], rows["split"]["blocks.0"]
    assert (full["calls"], split["calls"]) == (1, 2)
    assert split["checkpoint_free_bytes"] == full["checkpoint_free_bytes"] > 0
