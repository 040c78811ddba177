"""``memdoctor profile --verify``: the verify loop (with a fake profile runner), its record in the
trace, ``summary.json``'s ``verified``, the report section, and one real end-to-end run on CPU."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from tracebuilder import TraceBuilder, completed_trace, tiny_mlp

from memdoctor import exitcodes
from memdoctor.analysis.verified import verified
from memdoctor.cli import main, parse_args
from memdoctor.cli.terminal import say
from memdoctor.config import config_for_summary, load_config
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult
from memdoctor.launch.verify import (
    OOM_FLOOR,
    RECORD_NAME,
    error_factor,
    nothing_to_verify,
    verify,
)
from memdoctor.launch.verify_round import VERIFY_STEPS, measure
from memdoctor.plan import timing
from memdoctor.plan.workload import corrected_workload
from memdoctor.report import build_summary
from memdoctor.report.render import render_report
from memdoctor.report.sections.verify import report_section
from memdoctor.trace import Trace, load_trace, save_trace

GiB = 1024**3
DATA = Path(__file__).parent / "data"
BERT32 = DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"  # 12.2 GB peak, b32 s512 fp32, on an H200


@pytest.fixture
def first_run(monkeypatch: pytest.MonkeyPatch) -> tuple[Trace, dict[str, Any]]:
    """The recorded BERT-base b32 trace judged against an 8 GiB budget: a plan that does not fit as is."""
    # the loop under test starts from a plan that micro-batches: an extra micro-batch priced at nothing
    # (this trace then plans micro-batch 16 x 2, as it did before the H200 calibration of that share)
    monkeypatch.setitem(timing.ACCUMULATION_FIXED_SHARE, "high", 0.0)
    trace = load_trace(BERT32)
    trace.header["settings"]["budget_bytes"] = 8 * GiB
    summary = build_summary(trace)
    assert summary["plan"]["fits"] and not summary["plan"]["fits_as_is"]
    return trace, summary


class FakeRunner:
    """Stands in for ``run_profile``: each call writes a small CUDA trace whose largest reserved figure
    is the next of ``outcomes`` ((exit code, reserved bytes[, step ms])), recording the config as
    applied."""

    def __init__(
        self, outcomes: list[tuple[int, ...]], *, applies: bool = True, step_ms: float = 300.0
    ) -> None:
        self.outcomes = list(outcomes)
        self.applies = applies
        self.step_ms = step_ms
        self.requests: list[ProfileRequest] = []

    def __call__(self, req: ProfileRequest) -> ProfileResult:
        self.requests.append(req)
        code, reserved, *ms = self.outcomes[len(self.requests) - 1]
        step_ms = ms[0] if ms else self.step_ms
        b = TraceBuilder(kind="cuda", budget_bytes=req.budget_bytes)
        b.add_model(tiny_mlp())
        b.add_steps(warmup=1, profiled=2)
        trace = b.end("completed" if code == exitcodes.OK else "oom").build()
        trace.steps[-1].memory["allocator"]["max_reserved"] = reserved
        if self.applies:
            trace.header["applied_config"] = req.config
        path = save_trace(trace, req.out_dir / "trace.jsonl.gz")
        status = {exitcodes.OK: "completed", exitcodes.OUT_OF_MEMORY: "oom"}.get(code, "exception")
        summary = {"step_time_ms": step_ms if code == exitcodes.OK else None}
        return ProfileResult(code, status, f"fake {status}", trace_path=path, summary=summary)


def _request(out: Path) -> ProfileRequest:
    return ProfileRequest(
        script="train.py", module=None, args=["--lr", "1"], out_dir=out, budget_bytes=8 * GiB
    )


def _verify(first_run: tuple[Trace, dict[str, Any]], tmp_path: Path, runner: FakeRunner, **kw: Any) -> Any:
    lines: list[str] = []
    record = verify(*first_run, _request(tmp_path), runner, lines.append, **kw)
    return record, lines


# ----------------------------------------------------------------------------------------- the loop


def test_a_plan_that_fits_is_verified_in_one_round(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    runner = FakeRunner([(exitcodes.OK, 7 * GiB), (exitcodes.OK, 7 * GiB, 400.0)])
    record, lines = _verify(first_run, tmp_path, runner)
    plan = first_run[1]["plan"]
    req = runner.requests[0]
    assert req.out_dir == tmp_path / "verify" and req.budget_bytes == 8 * GiB and req.args == ["--lr", "1"]
    assert req.config is not None and req.config["accumulation_steps"] == plan["config"]["accumulation_steps"]
    assert load_config(tmp_path / "verify" / "memdoctor.yaml").as_dict() == req.config  # what it applied
    r, compared = record["rounds"]  # the second: the best plan without the first one's micro-batching
    assert compared["avoided"] == "accumulation" and r["avoided"] is None
    assert compared["config"]["accumulation_steps"] == 1 < plan["config"]["accumulation_steps"]
    assert runner.requests[1].out_dir == tmp_path / "verify-2"
    # every round profiles enough timing steps for a median (the request's own 5 are fewer)
    assert [q.steps for q in runner.requests] == [VERIFY_STEPS, VERIFY_STEPS] and req.steps > _request(
        tmp_path
    ).steps
    assert r["fits"] and r["outcome"] == "fits" and record["stopped"] is None
    assert r["predicted_peak_bytes"] == plan["predicted_reserved_bytes"]
    assert r["measured_peak_bytes"] == 7 * GiB and r["peak_basis"] == "reserved"
    # over the first run's timing steps (its steps without module hooks), as the verified run's are taken
    timing = [
        x.duration_ms for x in first_run[0].steps if x.detail == "timing" and not x.warmup and x.complete
    ]
    assert timing and r["step_time_basis"] == "profiled steps"  # the fake round's trace has no timing steps
    assert r["measured_step_time_ratio"] == pytest.approx(300.0 / statistics.median(timing), rel=1e-3)
    assert r["trace"] == "verify/trace.jsonl.gz"
    assert any("verify round 1/3" in line and "fits the budget" in line for line in lines)


def test_oom_then_over_budget_re_plans_until_it_fits(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    runner = FakeRunner(
        [(exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OK, 9 * GiB), (exitcodes.OK, 6 * GiB)]
    )
    record, lines = _verify(first_run, tmp_path, runner)
    rounds = record["rounds"]
    assert [r["outcome"] for r in rounds] == ["oom", "over_budget", "fits"]
    assert [q.out_dir.name for q in runner.requests] == ["verify", "verify-2", "verify-3"]
    corrections = [r["correction"] for r in rounds]
    assert corrections[0] == 1.0 < corrections[1] < corrections[2]
    # round 2 plans as if the first round had needed OOM_FLOOR x the budget
    assert corrections[1] == pytest.approx(8 * GiB * OOM_FLOOR / rounds[0]["predicted_peak_bytes"], rel=1e-3)
    # each re-plan asks for no more memory before correction (a lever such as expandable segments
    # lowers the reserved prediction only): a more aggressive config every round
    allocated = [r["predicted_allocated_peak_bytes"] for r in rounds]
    assert allocated[0] >= allocated[1] >= allocated[2]
    assert all(r["predicted_peak_bytes"] <= 8 * GiB * 0.9 for r in rounds)  # each plan fitted when made
    assert runner.requests[0].config != runner.requests[1].config != runner.requests[2].config
    assert record["stopped"] is None
    assert sum("re-planned with" in line for line in lines) == 2
    assert any("the plan is now round 3's config (verify-3/trace.jsonl.gz): apply" in line for line in lines)


def test_after_a_re_plan_that_fits_the_report_plans_as_that_round(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    """memdoctor.yaml beside the first report must be the plan a verified run fitted, not the first one
    (which `memdoctor run --config` would otherwise apply and run out of memory with)."""
    trace, summary = first_run
    first = summary["plan"]
    runner = FakeRunner(
        [(exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OK, 6 * GiB), (exitcodes.OK, 6 * GiB, 900.0)]
    )
    record, _ = _verify(first_run, tmp_path, runner)
    assert [r["outcome"] for r in record["rounds"]] == ["oom", "fits", "fits"]
    assert record["rounds"][2]["avoided"] is not None  # compared, slower: round 2 stays the plan
    trace.collected[RECORD_NAME] = record
    summary2 = build_summary(trace)
    plan = summary2["plan"]
    assert plan["config"] != first["config"]
    written = config_for_summary(trace, summary2)
    assert written is not None
    applied = dict(runner.requests[1].config or {})
    assert {k: v for k, v in written.as_dict().items() if k != "provenance"} == {
        k: v for k, v in applied.items() if k != "provenance"
    }
    # the same re-plan (the recorded correction is rounded)
    assert plan["predicted_reserved_bytes"] == pytest.approx(
        record["rounds"][1]["predicted_peak_bytes"], rel=1e-4
    )
    assert "the plan verify round 2 measured" in plan["advice"][0] and "raised x" in plan["advice"][0]
    assert plan["verified_fits"] is True and written.provenance.verified is True
    # a last round that did not fit never leaves the first plan (which it saw run out of memory) as the
    # plan: the report's is the re-plan with what that round taught, marked as not verified to fit
    trace.collected[RECORD_NAME] = {**record, "rounds": record["rounds"][:1]}
    unverified = build_summary(trace)["plan"]
    assert unverified["config"] != first["config"] and unverified["config"] == plan["config"]
    assert unverified["verified_fits"] is False and "NOT verified to fit" in unverified["advice"][0]


def test_rounds_are_capped(first_run: tuple[Trace, dict[str, Any]], tmp_path: Path) -> None:
    runner = FakeRunner([(exitcodes.OK, 9 * GiB)] * 2)
    record, lines = _verify(first_run, tmp_path, runner, max_rounds=2)
    assert len(record["rounds"]) == 2 and not record["rounds"][-1]["fits"]
    assert "--verify-rounds" in record["stopped"] and any("stopped" in line for line in lines)


@pytest.mark.parametrize(
    ("runner", "why"),
    [
        (FakeRunner([(exitcodes.SCRIPT_FAILED, 1 * GiB)]), "failed"),
        (FakeRunner([(exitcodes.OK, 9 * GiB)], applies=False), "does not record the config as applied"),
    ],
)
def test_what_a_re_plan_cannot_fix_stops_the_loop(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path, runner: FakeRunner, why: str
) -> None:
    record, _ = _verify(first_run, tmp_path, runner)
    assert len(runner.requests) == 1 and len(record["rounds"]) == 1
    assert why in record["stopped"]


def test_nothing_to_verify_runs_nothing(tmp_path: Path) -> None:
    trace = completed_trace(kind="cuda", budget_bytes=64 * GiB, layers=2)  # fits as it is
    runner = FakeRunner([])
    lines: list[str] = []
    record = verify(trace, build_summary(trace), _request(tmp_path), runner, lines.append)
    assert runner.requests == [] and record["rounds"] == []
    assert "fits its budget as it is" in record["skipped"] and "not verified" in lines[0]
    assert nothing_to_verify(None) is not None
    assert "nothing the planner models fits" in str(nothing_to_verify({"fits": False, "fits_as_is": False}))
    assert nothing_to_verify({"fits": True, "fits_as_is": False}) is None


def test_a_run_profiled_with_a_config_is_not_verified(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    first_run[0].header["applied_config"] = {"memdoctor_config": 1}
    runner = FakeRunner([])
    record, _ = _verify(first_run, tmp_path, runner)
    assert runner.requests == [] and "--config" in record["skipped"]


def test_error_factor_and_correction(first_run: tuple[Trace, dict[str, Any]]) -> None:
    over = {"outcome": "over_budget", "measured_peak_bytes": 9 * GiB, "predicted_peak_bytes": 6 * GiB}
    assert error_factor(over, 8 * GiB) == pytest.approx(1.5)
    oom = {"outcome": "oom", "measured_peak_bytes": 7 * GiB, "predicted_peak_bytes": 6 * GiB}
    assert error_factor(oom, 8 * GiB) == pytest.approx(8 * OOM_FLOOR / 6)
    low = {"outcome": "over_budget", "measured_peak_bytes": 1, "predicted_peak_bytes": 6 * GiB}
    assert error_factor(low, 8 * GiB) == 1.0  # never lowers a prediction
    from memdoctor.plan.config import Config
    from memdoctor.plan.model import predict, workload

    w = workload(*first_run)
    assert w is not None
    raised = corrected_workload(w, 1.5)
    assert predict(raised, Config()).reserved_bytes == pytest.approx(
        1.5 * predict(w, Config()).reserved_bytes, 1e-6
    )
    assert "raised x1.500" in raised.notes[-1] and w.notes != raised.notes


def test_measure_cpu_trace_uses_tensor_accounting() -> None:
    trace = completed_trace(kind="cpu", budget_bytes=None, layers=2)
    m = measure(trace, {"step_time_ms": 12.0})
    assert m["peak_basis"] == "accounting" and m["measured_peak_bytes"] == max(
        s.memory["peak_bytes"] for s in trace.steps
    )
    assert m["measured_step_time_ms"] == 12.0 and m["config_applied"] is False
    assert measure(None, None)["peak_basis"] is None


# ----------------------------------------------------------------------------------------- summary, report


def _verified_trace(first_run: tuple[Trace, dict[str, Any]], tmp_path: Path) -> Trace:
    """Out of memory, then a re-plan that fits, then the compared plan: it fits and is faster."""
    outcomes = [
        (exitcodes.OUT_OF_MEMORY, 7 * GiB),
        (exitcodes.OK, 6 * GiB, 300.0),
        (exitcodes.OK, 13 * GiB // 2, 200.0),
    ]
    runner = FakeRunner(outcomes)
    record, _ = _verify(first_run, tmp_path, runner)
    trace = first_run[0]
    trace.collected[RECORD_NAME] = record
    return load_trace(save_trace(trace, tmp_path / "first.jsonl.gz"))  # as written: survives a reload


def test_summary_verified_shape(first_run: tuple[Trace, dict[str, Any]], tmp_path: Path) -> None:
    trace = _verified_trace(first_run, tmp_path)
    v = build_summary(trace)["verified"]
    required = {
        "measured_peak_bytes",
        "predicted_peak_bytes",
        "measured_step_time_ratio",
        "predicted_step_time_ratio",
        "fits",
        "rounds",
        "trace",
    }
    assert required <= set(v)
    # the compared round (the best plan without the re-plan's micro-batching) measured faster: the plan
    assert (
        v["rounds"] == 3 and v["round"] == 3 and v["fits"] is True and v["trace"] == "verify-3/trace.jsonl.gz"
    )
    assert v["avoided"] == "accumulation" and v["measured_step_time_ms"] == 200.0
    assert v["measured_peak_bytes"] == 13 * GiB // 2 and v["peak_basis"] == "reserved"
    assert v["peak_error"] == pytest.approx(
        (13 * GiB // 2 - v["predicted_peak_bytes"]) / v["predicted_peak_bytes"], abs=1e-4
    )
    assert [h["outcome"] for h in v["history"]] == ["oom", "fits", "fits"]
    json.dumps(v, allow_nan=False)
    summary = build_summary(trace)
    plan = summary["plan"]
    assert plan["avoided"] == "accumulation" and plan["config"]["accumulation_steps"] == 1
    assert "the best plan without accumulation measured a shorter step" in plan["advice"][0]
    ctx = report_section(trace, summary)
    assert ctx is not None and ctx["chart"].startswith("data:image/svg+xml") and len(ctx["rounds"]) == 3
    html = render_report(trace)
    assert 'id="verify-rounds"' in html and "verify-3/memdoctor.yaml" in html
    assert "compared: the best plan without accumulation" in html


def test_a_compared_plan_within_the_noise_does_not_replace_the_plan(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    runner = FakeRunner([(exitcodes.OK, 7 * GiB, 300.0), (exitcodes.OK, 7 * GiB, 295.0)])  # 1.7% faster
    record, _ = _verify(first_run, tmp_path, runner)
    trace, first = first_run
    trace.collected[RECORD_NAME] = record
    summary = build_summary(trace)
    assert summary["plan"]["config"] == first["plan"]["config"] and summary["verified"]["round"] == 1
    record["rounds"][1]["measured_step_time_ms"] = 250.0
    assert build_summary(trace)["plan"]["config"]["accumulation_steps"] == 1


def test_unverified_report_says_so() -> None:
    trace = completed_trace(layers=2)
    assert verified(trace) is None and build_summary(trace)["verified"] is None
    assert report_section(trace, {}) is None
    html = render_report(trace)
    section = html[html.index('id="verify"') :]
    assert "Not verified" in section and "run with --verify" in section


def test_skipped_verification_says_why() -> None:
    trace = completed_trace(layers=2)
    trace.collected[RECORD_NAME] = {"skipped": "the profiled run fits its budget as it is", "rounds": []}
    assert build_summary(trace)["verified"] is None
    html = render_report(trace)
    assert "Not verified: the profiled run fits its budget as it is" in html


def test_a_verified_run_s_own_report_says_what_it_is() -> None:
    trace = completed_trace(layers=2)
    trace.header["applied_config"] = {"memdoctor_config": 1, "accumulation_steps": 2}
    ctx = report_section(trace, {})
    assert ctx is not None and "itself the run that verifies a plan" in ctx["skipped"]


def test_hostile_record_is_escaped_and_tolerated() -> None:
    trace = completed_trace(layers=2)
    evil = "<script>alert(1)</script>"
    trace.collected[RECORD_NAME] = {
        "oom_floor": "x",
        "rounds": [
            {"round": 1, "levers": [evil], "trace": evil, "measured_peak_bytes": "lots", "correction": [2]},
            "junk",
        ],
        "stopped": evil,
    }
    html = render_report(trace)
    assert evil not in html and "&lt;script&gt;" in html
    assert build_summary(trace)["verified"]["rounds"] == 1


# ----------------------------------------------------------------------------------------- command line


def test_verify_options() -> None:
    ns = parse_args(["profile", "--verify", "train.py"])
    assert ns.verify is True and ns.verify_rounds == 3
    assert parse_args(["profile", "--verify", "--verify-rounds", "1", "train.py"]).verify_rounds == 1
    assert main(["profile", "--verify-rounds", "0", "train.py"]) == exitcodes.USAGE_ERROR


def test_verify_profile_records_in_the_first_trace_and_re_renders(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's glue: the record lands in the first trace and the first report is re-rendered."""
    from memdoctor.launch.rounds import verify_profile

    trace, summary = first_run
    path = save_trace(trace, tmp_path / "trace.jsonl.gz")
    (tmp_path / "report.html").write_text("old")
    result = ProfileResult(exitcodes.OK, "completed", "ok", trace_path=path, summary=summary)
    runner = FakeRunner([(exitcodes.OK, 7 * GiB), (exitcodes.OK, 7 * GiB)])
    written = verify_profile(_request(tmp_path), result, 3, runner, say)
    assert tmp_path / "verify" / "trace.jsonl.gz" in written
    assert load_trace(path).collected[RECORD_NAME]["rounds"][0]["fits"] is True
    assert json.loads((tmp_path / "summary.json").read_text())["verified"]["fits"] is True
    assert 'id="verify-rounds"' in (tmp_path / "report.html").read_text()
    failed = ProfileResult(exitcodes.SCRIPT_FAILED, "exception", "boom", trace_path=path, summary=summary)
    runner = FakeRunner([])
    assert verify_profile(_request(tmp_path), failed, 3, runner, say) == [] and runner.requests == []
    assert "not verified: the profiled run ended with exception" in capsys.readouterr().err


VERIFY_LOOP = """
import torch

torch.manual_seed(0)
nn = torch.nn
block = nn.Sequential(nn.Linear(256, 256), nn.Tanh())
model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), block, nn.Linear(256, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8192, 32)), batch_size=2048)
for (x,) in loader:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_profile_verify_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real supervisor on a tiny CPU loop: both traces, ``verified``, the section, exit code 0."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(VERIFY_LOOP)
    # activations are 4.3 MiB of a 4.6 MiB peak: at 4 MiB the plan checkpoints
    argv = [
        "profile",
        "--warmup",
        "0",
        "--steps",
        "2",
        "--budget",
        "4MiB",
        "--verify",
        "-o",
        "out",
        "loop.py",
    ]
    assert main(argv) == exitcodes.OK
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    v = summary["verified"]
    assert v is not None and v["rounds"] >= 1
    assert any(h["peak_basis"] == "accounting" and h["measured_peak_bytes"] > 0 for h in v["history"])
    # round 1 applied the first plan: the plan the first trace makes without the verify record
    unverified = load_trace(out / "trace.jsonl.gz")
    del unverified.collected[RECORD_NAME]
    first_plan = build_summary(unverified)["plan"]
    assert first_plan["fits"] and not first_plan["fits_as_is"]
    first = v["history"][0]
    assert first["levers"] == first_plan["levers"]
    assert first["predicted_peak_bytes"] == first_plan["predicted_reserved_bytes"]
    # the plan is a measured config that fits, or says plainly that it is not (this loop's forward
    # returns no loss: memdoctor run may refuse micro-batching it, and that lever is then left out)
    assert summary["plan"]["verified_fits"] is v["plan_verified"]
    yaml_text = (out / "memdoctor.yaml").read_text()
    assert yaml_text.startswith("# NOT PLANNED TO FIT") is not v["plan_verified"]
    if first["outcome"] == "refused":
        assert first["refused_lever"] == "accumulation"
        later = load_trace(out / "trace.jsonl.gz").collected[RECORD_NAME]["rounds"][1:]
        assert all(r["config"]["accumulation_steps"] == 1 for r in later)
    for h in v["history"]:
        assert load_trace(out / h["trace"]).end is not None  # each round's own whole trace, beside the first
    assert load_trace(out / "trace.jsonl.gz").collected[RECORD_NAME]["rounds"]
    html = (out / "report.html").read_text()
    assert 'id="verify-rounds"' in html
    err = capsys.readouterr().err
    assert "verify round 1/3" in err


def test_a_compared_plan_that_runs_out_of_memory_is_re_planned_with_its_error(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    outcomes = [
        (exitcodes.OK, 7 * GiB, 300.0),
        (exitcodes.OUT_OF_MEMORY, 8 * GiB),
        (exitcodes.OK, 7 * GiB, 200.0),
    ]
    runner = FakeRunner(outcomes)
    record, lines = _verify(first_run, tmp_path, runner)
    first, compared, again = record["rounds"]
    assert first["avoided"] is None and compared["avoided"] == again["avoided"] == "accumulation"
    assert compared["margin"] == again["margin"] == 0.05 and compared["outcome"] == "oom"
    assert again["correction"] > compared["correction"] == 1.0
    assert runner.requests[1].config != runner.requests[2].config
    assert any("re-planned the plan without accumulation" in line for line in lines)
    trace, _ = first_run
    trace.collected[RECORD_NAME] = record
    plan = build_summary(trace)["plan"]
    # the report's plan is round 3's: the same search (its correction, half the margin, no micro-batching)
    assert plan["config"]["accumulation_steps"] == 1 and plan["safety_margin"] == 0.05
    assert plan["predicted_reserved_bytes"] == pytest.approx(again["predicted_peak_bytes"], rel=1e-4)
    assert "verify round 3" in plan["advice"][0]


def test_a_verified_step_time_is_its_timing_steps_when_it_has_them() -> None:
    """Ledger steps run module hooks (more of them for a checkpointed plan, whose recomputed modules run
    them again): plans are compared by the steps without them."""
    trace = load_trace(BERT32)
    timing = [s.duration_ms for s in trace.steps if s.detail == "timing" and not s.warmup and s.complete]
    measured = measure(trace, {"step_time_ms": 1.0})
    assert measured["step_time_basis"] == "timing steps"
    assert measured["measured_step_time_ms"] == pytest.approx(statistics.median(timing), abs=1e-3)
    for s in trace.steps:
        s.detail = "full"
    assert measure(trace, {"step_time_ms": 1.0})["measured_step_time_ms"] == 1.0


def test_the_report_says_which_rounds_failed_and_when_no_plan_is_verified(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path
) -> None:
    trace, _ = first_run
    runner = FakeRunner(
        [(exitcodes.OUT_OF_MEMORY, 7 * GiB), (exitcodes.OK, 6 * GiB), (exitcodes.OK, 6 * GiB, 900.0)]
    )
    record, _ = _verify(first_run, tmp_path, runner)
    trace.collected[RECORD_NAME] = record
    html = render_report(trace)
    section = html[html.index('id="verify"') :]
    assert "The first plan did not fit: the plan is a later round" in section
    assert "round 1 (" in section and "ran out of memory (" in section
    assert 'id="verify-not-planned"' not in section
    trace.collected[RECORD_NAME] = {**record, "rounds": record["rounds"][:1]}  # only the OOM round
    html = render_report(trace)
    section = html[html.index('id="verify"') :]
    assert 'id="verify-not-planned"' in section and "memdoctor.yaml is not planned to fit" in section
    assert "NOT verified to fit" in section and "memdoctor profile --config memdoctor.yaml" in section


def test_verify_profile_says_when_no_round_fits(
    first_run: tuple[Trace, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The terminal says what memdoctor.yaml now is when every round failed; the file's header too."""
    from memdoctor.launch.rounds import verify_profile

    trace, summary = first_run
    path = save_trace(trace, tmp_path / "trace.jsonl.gz")
    result = ProfileResult(exitcodes.OK, "completed", "ok", trace_path=path, summary=summary)
    runner = FakeRunner([(exitcodes.OUT_OF_MEMORY, 7 * GiB)] * 2)
    verify_profile(_request(tmp_path), result, 2, runner, say)
    err = capsys.readouterr().err
    assert "verify: no round fits the budget: " in err and "memdoctor.yaml is NOT planned to fit" in err
    assert "This config is the planner's re-plan after those rounds (memory predictions raised x" in err
    text = (tmp_path / "memdoctor.yaml").read_text()
    assert (
        text.startswith("# NOT PLANNED TO FIT")
        and load_config(tmp_path / "memdoctor.yaml").provenance.verified is False
    )
    assert json.loads((tmp_path / "summary.json").read_text())["verified"]["plan_verified"] is False
