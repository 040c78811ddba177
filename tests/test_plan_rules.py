"""Each rule fires on a hand-built trace that shows its problem, and stays silent on one that does not."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from memdoctor.analysis.steps import peak_step
from memdoctor.cards import find_card
from memdoctor.plan import rules as R
from memdoctor.plan.agreement import plan_notes
from memdoctor.plan.model import workload
from memdoctor.plan.padding import Padding
from memdoctor.plan.planner import make_plan
from memdoctor.plan.target import Target
from memdoctor.report import build_summary
from memdoctor.trace import Trace
from tests.tracebuilder import GiB, MiB, TraceBuilder, completed_trace, tiny_mlp

KEYS = {"rule", "severity", "title", "evidence", "saving_bytes", "cost_fraction", "confidence"}


@pytest.fixture(scope="module")
def bert() -> tuple[Trace, dict[str, Any]]:
    trace = completed_trace(kind="cuda", budget_bytes=8 * GiB, layers=4)
    return trace, build_summary(trace)


def _run(
    rule: Any, trace: Trace, summary: dict[str, Any], target: Target | None = None
) -> list[dict[str, Any]]:
    found = rule(R.RuleInput(trace, summary, workload(trace, summary), target))
    for f in found:
        assert set(f) == KEYS and f["evidence"]
    return found


def test_checkpointing_fires_when_activations_dominate(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    w = workload(trace, summary)
    assert w is not None and w.activations > 0.3 * w.peak_bytes
    tight = Target(int(w.peak_bytes * 0.8))
    (f,) = _run(R.checkpointing, trace, summary, tight)
    assert f["severity"] == "critical" and f["saving_bytes"] > 0 and f["cost_fraction"] > 0
    (roomy,) = _run(R.checkpointing, trace, summary, Target(100 * GiB))
    assert roomy["severity"] == "info"


def test_checkpointing_silent_when_activations_are_small() -> None:
    b = TraceBuilder(kind="cuda")
    b.add_model([(n, t, p * 1000, a // 1000) for n, t, p, a in tiny_mlp()])
    b.add_steps(warmup=1, profiled=2)
    trace = b.end("completed").build()
    assert _run(R.checkpointing, trace, build_summary(trace)) == []


def test_mixed_precision(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    assert _run(R.mixed_precision, trace, summary) == [], "silent when precision was not measured"
    s = copy.deepcopy(summary)
    s["precision"] = {"verdict": "fp16_safe", "title": "fp16 + GradScaler is safe", "reason": "fits"}
    s["precision"].update(bf16_available=True, suggested_init_scale_log2=12)
    (bf16,) = _run(R.mixed_precision, trace, s)
    assert "bf16" in bf16["title"] and bf16["saving_bytes"] > 0
    (fp16,) = _run(R.mixed_precision, trace, s, Target(8 * GiB, find_card("rtx2070")))
    assert "fp16" in fp16["title"] and "init_scale=2**12" in fp16["evidence"]
    s["precision"].update(verdict="bf16_only", reason="activations overflow fp16")
    (warn,) = _run(R.mixed_precision, trace, s, Target(8 * GiB, find_card("t4")))
    assert warn["severity"] == "warning" and "overflow" in warn["evidence"]


def test_memory_efficient_attention(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    assert _run(R.memory_efficient_attention, trace, summary) == [], "silent without a peak ledger"
    peak = summary["peak_memory_bytes"]
    s = copy.deepcopy(summary)
    site = "modeling_bert.py:125 (eager_attention_forward) <- train.py:40 (main)"
    s["peak_ledger"] = {"temporaries_by_site": [[site, peak // 10], ["linear.py:134 (forward)", peak // 10]]}
    (f,) = _run(R.memory_efficient_attention, trace, s)
    assert f["saving_bytes"] == peak // 10 and "eager_attention_forward" in f["evidence"]
    s["peak_ledger"]["temporaries_by_site"] = [[site, peak // 1000], ["linear.py:134 (forward)", peak // 5]]
    assert _run(R.memory_efficient_attention, trace, s) == [], "silent when attention temporaries are small"


def test_memory_efficient_attention_on_the_recorded_oom() -> None:
    from pathlib import Path

    from memdoctor.trace import load_trace

    trace = load_trace(Path(__file__).parent / "data" / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz")
    (f,) = _run(R.memory_efficient_attention, trace, build_summary(trace))
    assert f["saving_bytes"] == 402653184  # 32 x 12 heads x 512 x 512 fp32 scores: seq x seq


def test_allocator_fragmentation() -> None:
    trace = completed_trace(kind="cuda", layers=2)
    summary = build_summary(trace)
    assert _run(R.allocator_fragmentation, trace, summary) == [], "the builder's 10% slack is below the bar"
    step = peak_step(trace)
    assert step is not None
    alloc = step.memory["allocator"]
    alloc["max_reserved"] = alloc["max_allocated"] + 2 * GiB
    (f,) = _run(R.allocator_fragmentation, trace, summary)
    assert f["saving_bytes"] == 2 * GiB and "expandable_segments" in f["title"]
    alloc["max_reserved"] = alloc["max_allocated"] + MiB
    alloc["num_alloc_retries"] = 3
    (retry,) = _run(R.allocator_fragmentation, trace, summary)
    assert "3 allocation retries" in retry["evidence"]
    cpu = completed_trace(kind="cpu", layers=2)
    assert _run(R.allocator_fragmentation, cpu, build_summary(cpu)) == []


def test_dataloader_starvation(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    assert _run(R.dataloader_starvation, trace, summary) == []
    s = dict(summary, dataloader_wait_fraction=0.05)
    assert _run(R.dataloader_starvation, trace, s) == []
    (f,) = _run(R.dataloader_starvation, trace, dict(summary, dataloader_wait_fraction=0.4))
    assert f["cost_fraction"] == -0.4 and f["saving_bytes"] == 0


def test_dynamic_padding(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    assert _run(R.dynamic_padding, trace, summary) == []
    assert _run(R.dynamic_padding, trace, dict(summary, padding_fraction=0.05)) == []
    s = dict(summary, padding_fraction=0.5, data={"lengths": {"p50": 100, "p90": 300, "max": 512}})
    (f,) = _run(R.dynamic_padding, trace, s)
    w = workload(trace, summary)
    assert w is not None and f["saving_bytes"] == int(w.activations * 0.5)
    assert "p90 300" in f["evidence"] and f["cost_fraction"] < 0


def test_optimizer_state_and_gradient_health(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    w = workload(trace, summary)
    assert w is not None
    assert _run(R.optimizer_state, trace, summary, Target(100 * w.optimizer_state)) == []
    (f,) = _run(R.optimizer_state, trace, summary, Target(2 * w.optimizer_state))
    assert f["saving_bytes"] == int(w.optimizer_state * 0.75)
    assert _run(R.gradient_health, trace, summary) == []
    flags = [
        {"kind": "nonfinite", "module": "bert.encoder.layer.1", "evidence": "NaN/Inf gradient in 3 modules"}
    ]
    (g,) = _run(R.gradient_health, trace, dict(summary, grad_flags=flags))
    assert g["severity"] == "critical"


def test_run_rules_keeps_the_rule_order(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    s = dict(summary, dataloader_wait_fraction=0.5, padding_fraction=0.5)
    found = R.run_rules(R.RuleInput(trace, s, workload(trace, s), Target(GiB)))
    order = [r.__name__ for r in R.RULES]
    assert [order.index(f["rule"]) for f in found] == sorted(order.index(f["rule"]) for f in found)
    assert {"checkpointing", "dataloader_starvation", "dynamic_padding"} <= {f["rule"] for f in found}


def test_checkpointing_saving_never_exceeds_the_activations(bert: tuple[Trace, dict[str, Any]]) -> None:
    """A saving is capped at what it saves from: with every block's measured frees inflated (as a
    re-profile scaled twice would give), the finding still frees at most the activations at the peak."""
    trace, summary = bert
    w = workload(trace, summary)
    assert w is not None
    inflated = dataclasses.replace(
        w, candidates=[dataclasses.replace(c, free_bytes=c.free_bytes * 2) for c in w.candidates]
    )
    (f,) = R.checkpointing(R.RuleInput(trace, summary, inflated, None))
    assert 0 < f["saving_bytes"] <= inflated.activations
    assert "capped" in f["evidence"]
    (plain,) = R.checkpointing(R.RuleInput(trace, summary, w, None))
    assert plain["saving_bytes"] < w.activations and "capped" not in plain["evidence"]


def test_checkpoint_saving_counts_a_nested_module_once(bert: tuple[Trace, dict[str, Any]]) -> None:
    """A block and the modules inside it free the block's bytes once, not the sum of the three."""
    trace, summary = bert
    w = workload(trace, summary)
    assert w is not None
    by_name = {c.name: c for c in w.candidates}
    blocks = [by_name[f"bert.encoder.layer.{i}"] for i in range(2)]
    inner = [c for c in w.candidates if c.name.startswith("bert.encoder.layer.0.")]
    assert inner, "the nested model has checkpoint candidates inside its blocks"
    assert R.checkpoint_saving(w, blocks + inner) == R.checkpoint_saving(w, blocks)
    assert R.checkpoint_saving(w, blocks) == blocks[0].free_bytes + blocks[1].free_bytes - max(
        c.free_bytes for c in blocks
    )


def test_checkpointing_names_the_kind_of_its_peak(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    (f,) = _run(R.checkpointing, trace, summary)
    assert "allocated peak, measured" in f["evidence"]


def _padded(w: Any, worst: int) -> Any:
    longest = (100, 200, 300, worst)
    return dataclasses.replace(w, padding=Padding(512, worst, longest, {"p90": 300.0}))


def test_padding_finding_and_plan_agree_on_the_peak(bert: tuple[Trace, dict[str, Any]]) -> None:
    """The padding finding's saving is the longest batch's (what sets the peak), and where the plan
    leaves padding out the finding says why: the long tail keeps a near full-length sequence."""
    trace, summary = bert
    w = workload(trace, summary)
    assert w is not None
    tail = _padded(w, 502)
    s = dict(summary, padding_fraction=0.4)
    (f,) = R.dynamic_padding(R.RuleInput(trace, s, tail, None))
    assert f["saving_bytes"] == int(tail.activations * (1 - 504 / 512)) < 0.4 * tail.activations
    plan = make_plan(tail, Target(int(w.peak_bytes * 0.8)))
    assert plan.chosen is not None
    plan_notes([f], plan, tail)
    assert plan.chosen.config.padding == "trim" and f["plan_note"] == "in the plan"
    config = dataclasses.replace(plan.chosen.config, padding="as-is", pad_to_multiple_of=None)
    kept = dataclasses.replace(plan, chosen=dataclasses.replace(plan.chosen, config=config))
    plan_notes([f], kept, tail)
    assert f["plan_note"].startswith("not in the plan") and "502-token" in f["plan_note"]
    short = _padded(w, 300)
    (g,) = R.dynamic_padding(R.RuleInput(trace, s, short, None))
    assert g["saving_bytes"] == int(short.activations * (1 - 304 / 512))


def test_every_finding_says_how_it_stands_with_the_plan(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, _ = bert
    summary = build_summary(trace)
    assert summary["plan"] is not None and summary["findings"]
    for f in summary["findings"]:
        family = R.RULE_FAMILY.get(f["rule"])
        assert (f["plan_note"] is not None) == (family is not None and f["saving_bytes"] > 0)
    (ckpt,) = [f for f in summary["findings"] if f["rule"] == "checkpointing"]
    used = bool(summary["plan"]["config"]["checkpoint"])
    assert ckpt["plan_note"].startswith("in the plan" if used else "not in the plan")


def test_no_plan_leaves_no_plan_note(bert: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert
    found = R.run_rules(R.RuleInput(trace, summary, workload(trace, summary), None))
    plan_notes(found, None, None)
    assert found and all(f["plan_note"] is None for f in found)
