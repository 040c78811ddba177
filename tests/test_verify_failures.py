"""``memdoctor profile --verify`` when rounds fail: a failing plan is never left as the plan, every
failed round says why, and a lever ``memdoctor run`` refused is never proposed again. The loop runs
in-process with a fake profile runner (no child process), on the recorded BERT-base b32 trace, whose
plan under 8 GiB micro-batches (accumulation) with bf16 autocast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tracebuilder import TraceBuilder, tiny_mlp

from memdoctor import exitcodes
from memdoctor.analysis.verified import refused_family, round_reason
from memdoctor.config import config_for_summary, dump_config, parse_config
from memdoctor.launch.run import describe
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult
from memdoctor.launch.verify import RECORD_NAME, verify
from memdoctor.plan import timing
from memdoctor.report import build_summary
from memdoctor.trace import Trace, load_trace, save_trace

GiB = 1024**3
BERT32 = Path(__file__).parent / "data" / "gpu-bert-base-b32-s512-fp32.jsonl.gz"
NO_LOSS = (
    "the plan could not be applied: accumulation_steps: the model's forward returns no loss (no labels "
    "passed, or a model that does not compute one), so memdoctor run cannot split the batch inside it"
)
REFUSED = "refused"  # an outcome: the supervisor's config_error (memdoctor exit code 2)


@pytest.fixture
def first_run(monkeypatch: pytest.MonkeyPatch) -> tuple[Trace, dict[str, Any]]:
    # the loop under test starts from a plan that micro-batches: an extra micro-batch priced at nothing
    # (this trace then plans micro-batch 16 x 2, as it did before the H200 calibration of that share)
    monkeypatch.setitem(timing.ACCUMULATION_FIXED_SHARE, "high", 0.0)
    trace = load_trace(BERT32)
    trace.header["settings"]["budget_bytes"] = 8 * GiB
    summary = build_summary(trace)
    assert summary["plan"]["config"]["accumulation_steps"] > 1  # the lever the refusal tests refuse
    return trace, summary


class Runner:
    """Stands in for ``run_profile``: each call's outcome is the next of ``outcomes``: (exit code,
    reserved bytes[, step ms]), or ("refused", message) for a plan ``memdoctor run`` cannot apply."""

    def __init__(self, outcomes: list[tuple[Any, ...]]) -> None:
        self.outcomes = list(outcomes)
        self.requests: list[ProfileRequest] = []

    def __call__(self, req: ProfileRequest) -> ProfileResult:
        self.requests.append(req)
        code, value, *ms = self.outcomes[len(self.requests) - 1]
        b = TraceBuilder(kind="cuda", budget_bytes=req.budget_bytes)
        b.add_model(tiny_mlp())
        trace_status = {exitcodes.OK: "completed", exitcodes.OUT_OF_MEMORY: "oom"}.get(code, "config_error")
        if code != REFUSED:  # a refused plan stops the script before its first step
            b.add_steps(warmup=1, profiled=2)
        trace = b.end(trace_status).build()
        if code != REFUSED:
            trace.steps[-1].memory["allocator"]["max_reserved"] = value
        trace.header["applied_config"] = req.config
        path = save_trace(trace, req.out_dir / "trace.jsonl.gz")
        if code == REFUSED:
            return ProfileResult(exitcodes.USAGE_ERROR, "config_error", value, trace_path=path, summary={})
        summary = {"step_time_ms": (ms[0] if ms else 300.0) if code == exitcodes.OK else None}
        return ProfileResult(code, trace_status, f"fake {trace_status}", trace_path=path, summary=summary)

    def configs(self) -> list[dict[str, Any]]:
        return [dict(r.config or {}) for r in self.requests]


def _levers(config: dict[str, Any]) -> dict[str, Any]:
    """A memdoctor.yaml mapping without its provenance (where it came from): what it applies."""
    return {k: v for k, v in config.items() if k != "provenance"}


def _verify(first_run: tuple[Trace, dict[str, Any]], tmp_path: Path, runner: Runner) -> tuple[Any, list[str]]:
    lines: list[str] = []
    req = ProfileRequest(script="train.py", module=None, args=[], out_dir=tmp_path, budget_bytes=8 * GiB)
    record = verify(*first_run, req, runner, lines.append)
    first_run[0].collected[RECORD_NAME] = record
    return record, lines


def test_every_round_out_of_memory_leaves_no_plan_presented_as_fitting(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, first = first_run
    runner = Runner([(exitcodes.OUT_OF_MEMORY, 7 * GiB)] * 3)
    record, _ = _verify(first_run, tmp_path, runner)
    assert [r["outcome"] for r in record["rounds"]] == ["oom"] * 3 and "--verify-rounds" in record["stopped"]
    assert record["learned"]["correction"] > record["rounds"][-1]["correction"]  # round 3 taught too
    summary = build_summary(trace)
    v, plan = summary["verified"], summary["plan"]
    assert v["plan_verified"] is False and v["first_shot_fits"] is False and v["fits"] is False
    assert v["reason"] == v["failed_rounds"][-1]["reason"]
    assert [f["round"] for f in v["failed_rounds"]] == [1, 2, 3]
    assert all(f["reason"].startswith("ran out of memory (") for f in v["failed_rounds"])
    assert "predicted" in v["failed_rounds"][0]["reason"]
    # not the first plan, which round 1 saw run out of memory; nor presented as planned to fit
    assert plan["config"] != first["plan"]["config"] and plan["verified_fits"] is False
    assert plan["verify_note"].startswith("NOT verified to fit") and "round 3" in plan["verify_note"]
    assert plan["advice"][0] == plan["verify_note"]
    config = config_for_summary(trace, summary)
    assert config is not None and config.provenance.verified is False
    text = dump_config(config)
    assert text.startswith("# NOT PLANNED TO FIT") and "memdoctor profile --config" in text
    assert parse_config(text) == config  # the header is comments: the file still loads
    assert "NOT verified to fit" in describe(config, tmp_path / "memdoctor.yaml")
    assert "planned to fit)" not in describe(config, tmp_path / "memdoctor.yaml")


def test_a_re_plan_that_fits_is_the_plan_and_the_first_shot_is_reported_as_failed(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, first = first_run
    runner = Runner(
        [(exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OK, 6 * GiB), (exitcodes.OK, 6 * GiB, 900.0)]
    )
    _verify(first_run, tmp_path, runner)
    summary = build_summary(trace)
    v, plan = summary["verified"], summary["plan"]
    assert v["round"] == 2 and v["plan_verified"] is True and v["first_shot_fits"] is False
    assert [(f["round"], f["outcome"]) for f in v["failed_rounds"]] == [(1, "oom")]
    config = config_for_summary(trace, summary)
    assert config is not None and config.provenance.verified is True
    assert _levers(config.as_dict()) == _levers(runner.configs()[1])  # round 2's measured config
    assert plan["config"] != first["plan"]["config"]
    text = dump_config(config)
    assert not text.startswith("# NOT") and "measured to fit by memdoctor profile --verify: round 2" in text
    assert describe(config, tmp_path / "m.yaml").endswith("(measured to fit by profile --verify)")


def test_a_refused_lever_is_left_out_of_every_later_plan(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, _ = first_run
    runner = Runner([(REFUSED, NO_LOSS), (exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OK, 6 * GiB)])
    record, lines = _verify(first_run, tmp_path, runner)
    r1, r2, r3 = record["rounds"]
    assert r1["outcome"] == "refused" and r1["refused_lever"] == "accumulation" and not r1["fits"]
    assert r1["correction"] == r2["correction"] == 1.0  # a refusal measured nothing: no memory correction
    assert r2["excluded"] == r3["excluded"] == ["accumulation"] and r1["excluded"] == []
    assert runner.configs()[0]["accumulation_steps"] > 1
    assert all(c["accumulation_steps"] == 1 for c in runner.configs()[1:])  # never proposed again
    assert record["learned"]["excluded"] == ["accumulation"]
    assert any("without accumulation (memdoctor run refused it" in line for line in lines)
    assert any("refused by memdoctor run: accumulation_steps: the model's forward" in line for line in lines)
    summary = build_summary(trace)
    v, plan = summary["verified"], summary["plan"]
    assert v["round"] == 3 and v["excluded"] == ["accumulation"]
    assert v["failed_rounds"][0]["reason"].startswith("refused by memdoctor run: accumulation_steps:")
    assert plan["config"]["accumulation_steps"] == 1 and plan["excluded"] == ["accumulation"]
    config = config_for_summary(trace, summary)
    assert config is not None
    assert _levers(config.as_dict()) == _levers(runner.configs()[2])  # round 3's measured config
    assert "memdoctor run refused it for this script" in plan["advice"][0]


def test_a_refused_compared_plan_is_re_planned_without_that_lever(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    """The plan fits; the compared plan (without micro-batching) is refused for another lever: the
    next compared plan leaves that one out too."""
    precision = "the plan could not be applied: precision: bf16: the script's own autocast is fp16"
    runner = Runner([(exitcodes.OK, 7 * GiB), (REFUSED, precision), (exitcodes.OK, 7 * GiB)])
    record, _ = _verify(first_run, tmp_path, runner)
    _, compared, again = record["rounds"]
    assert compared["avoided"] == "accumulation" and compared["config"]["precision"] == "bf16"
    assert compared["refused_lever"] == "precision" and again["excluded"] == ["precision"]
    assert again["config"]["precision"] == "fp32" and again["config"]["accumulation_steps"] == 1


def test_a_refusal_no_re_plan_can_avoid_stops_the_loop(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    stale = "the plan could not be applied: config names modules this model lacks: 'bert.x'"
    runner = Runner([(REFUSED, stale)])
    record, _ = _verify(first_run, tmp_path, runner)
    assert len(runner.requests) == 1 and record["rounds"][0]["refused_lever"] is None
    assert "no lever the planner can leave out" in record["stopped"]
    plan = build_summary(first_run[0])["plan"]
    assert plan["verified_fits"] is False and "refused by memdoctor run: config names" in plan["verify_note"]


@pytest.mark.parametrize(
    ("message", "config", "family"),
    [
        (NO_LOSS, {"accumulation_steps": 2}, "accumulation"),
        (NO_LOSS, {"accumulation_steps": 1}, None),  # a config that does not use it: not that lever
        ("optimizer: 8bit: memdoctor run cannot swap the script's optimizer", {"optimizer": "8bit"}, "8bit"),
        ("optimizer: offload: Adam, built after", {"optimizer": "offload"}, "offload"),
        ("precision: fp16: no optimizer of the model exists", {"precision": "fp16"}, "precision"),
        ("attention: sdpa: cannot set it on this model", {"attention": "sdpa"}, "attention"),
        ("checkpointing failed somewhere", {"checkpoint": ["a"]}, None),  # no field named
        (None, {"accumulation_steps": 2}, None),
    ],
)
def test_refused_family(message: str | None, config: dict[str, Any], family: str | None) -> None:
    assert refused_family(message, config) == family


def test_round_reasons_name_the_figures() -> None:
    oom = {"outcome": "oom", "predicted_peak_bytes": 7 * GiB, "measured_peak_bytes": None}
    assert round_reason(oom) == "ran out of memory (7.00 GiB predicted)"
    over = {"outcome": "over_budget", "predicted_peak_bytes": 6 * GiB, "measured_peak_bytes": 9 * GiB}
    assert round_reason(over) == "over the budget: measured 9.00 GiB vs 6.00 GiB predicted"
    failed = {"outcome": "failed", "status": "exception", "message": "boom"}
    assert round_reason(failed) == "the run failed (exception: boom)"


def test_a_record_without_learned_plans_from_what_its_rounds_say(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    """A verify record written before ``learned`` existed: none fits, so the plan is still not the
    first one, and is re-made with the rounds' largest correction and without their refused levers."""
    trace, first = first_run
    runner = Runner(
        [(REFUSED, NO_LOSS), (exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OUT_OF_MEMORY, 7 * GiB)]
    )
    record, _ = _verify(first_run, tmp_path, runner)
    del record["learned"]
    plan = build_summary(trace)["plan"]
    assert plan["excluded"] == ["accumulation"] and plan["config"]["accumulation_steps"] == 1
    assert plan["verified_fits"] is False and plan["config"] != first["plan"]["config"]


def test_the_compared_plan_never_uses_a_refused_lever(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    runner = Runner([(REFUSED, NO_LOSS), (exitcodes.OK, 7 * GiB), (exitcodes.OK, 7 * GiB)])
    record, _ = _verify(first_run, tmp_path, runner)
    _, fitted, compared = record["rounds"]
    assert fitted["fits"] and compared["avoided"] == "checkpoint" and compared["excluded"] == ["accumulation"]
    assert compared["config"]["accumulation_steps"] == 1 and not compared["config"]["checkpoint"]
