"""Plans from H200 traces of session 6 (BENCHMARKS.md, "Issue 15 re-measured, 2026-12-04"): GPT-2's bf16
what-if against the measured bf16 run, and a run that died in its root's logits upcast."""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import peak_step
from memdoctor.plan.config import EXPANDABLE_SEGMENTS, Config
from memdoctor.plan.measure import amp_factor, measured_workload
from memdoctor.plan.memory import memory_parts
from memdoctor.plan.model import predict
from memdoctor.plan.workload import Workload
from memdoctor.report import build_summary
from memdoctor.trace import load_trace

pytestmark = pytest.mark.fast
DATA = Path(__file__).parent / "data"


def test_gpt2_bf16_what_if_is_not_under_the_measured_bf16_run() -> None:
    """GPT-2 small, Trainer, b16 x 512, uncapped: the bf16 prediction from the fp32 profile is at or over
    the measured bf16 peak and within 5% of it (its tanh GELU's pow keeps most of what it saves fp32;
    taken at 0.5 it was 10.6% under, and the first-shot plan of bf16 alone ran out of memory)."""
    fp32 = load_trace(DATA / "gpu-gpt2-small-trainer-b16-s512-fp32-uncapped.jsonl.gz")
    bf16 = load_trace(DATA / "gpu-gpt2-small-trainer-b16-s512-bf16-uncapped.jsonl.gz")
    w = measured_workload(fp32, build_summary(fp32))
    assert w is not None
    predicted = sum(memory_parts(w, Config(precision="bf16"), [], []).values())
    measured = build_summary(bf16)["peak_memory_bytes"]
    assert measured <= predicted <= 1.05 * measured


def test_a_run_that_died_in_its_root_upcast_is_never_planned_as_fitting_unchanged() -> None:
    """The minimal GPT died at 5.78 GiB of 8 in its logits upcast; no re-profile measured it. Its plan
    was "no levers, fits, 7.25 GiB": the unchanged config is now known to run out of memory."""
    trace = load_trace(DATA / "gpu-mini-gpt-124m-b12-s1024-8gib-died-in-upcast.jsonl.gz")
    summary = build_summary(trace)
    w = measured_workload(trace, summary)
    assert w is not None and w.as_is_oom_budget == 8 * 2**30
    assert summary["plan"]["levers"], summary["plan"]


def test_gradients_the_peak_ledger_counted_are_not_counted_again_in_the_fixed_rest() -> None:
    """GPT-2's re-profile at 1/2 (H100, session 8) died in its second micro-batch's backward with the
    first one's gradients live: the peak ledger counted them (0.50 GB), the step's categories had them
    in "other". The plan counted them as gradients and again in the fixed rest, 0.50 GB too high.
    Rebuilt here on the minimal GPT's re-profile by moving its gradients into "other" the same way."""
    trace = load_trace(DATA / "gpu-mini-gpt-124m-b12-s1024-8gib-reprofile.jsonl.gz")
    summary = build_summary(trace)
    as_recorded = measured_workload(trace, summary)
    moved = copy.deepcopy(summary)
    grads = moved["categories"]["gradients"]
    assert grads > 0 and moved["peak_ledger"]["categories"]["gradients"] > 0
    moved["categories"]["gradients"] = 0
    moved["categories"]["other"] = (moved["categories"].get("other") or 0) + grads
    w = measured_workload(trace, moved)
    assert w is not None and as_recorded is not None
    assert w.fixed <= as_recorded.fixed + (grads - moved["peak_ledger"]["categories"]["gradients"])
    assert w.gradients_at_peak == moved["peak_ledger"]["categories"]["gradients"]
    unchanged = sum(memory_parts(w, Config(), [], []).values())
    assert unchanged == summary["peak_memory_bytes"], "the unchanged config still predicts the peak"


def _llama() -> tuple[Workload | None, dict[str, Any]]:
    trace = load_trace(DATA / "gpu-llama-1p1b-b4-s1024-8gib-full-offload.jsonl.gz")
    raw = DATA.parent.parent / "benchmarks" / "results-h200-2026-12-04-session6.json"
    results = json.loads(raw.read_text())
    return measured_workload(trace, build_summary(trace)), results["results"]["1.1B full offload (call 5)"]


def test_full_offload_counts_autocast_s_weight_cache_or_the_gradients_never_both() -> None:
    """Under full offload the 16-bit weight copies live through the forward and the gradients come in the
    backward: the 1.1B decoder's plan counted both (+0.88 GB) and over-predicted its allocated peak by
    15.6% on the H200."""
    w, _ = _llama()
    assert w is not None
    config = Config(precision="bf16", full_offload=True, allocator=EXPANDABLE_SEGMENTS, attention="sdpa")
    notes: list[str] = []
    parts = memory_parts(w, config, [], notes)
    assert parts["autocast_weight_cache"] > 0 and parts["gradients"] == 0
    assert any("never live together" in n for n in notes)
    fp32 = memory_parts(w, Config(full_offload=True), [], [])
    assert fp32["gradients"] > 0, "without autocast the gradients stay"


def test_full_offload_plan_of_the_h200_run_predicts_its_reserved_peak_within_5_percent() -> None:
    """The plan the H200 ran on 2026-12-04 (layers 1-19 checkpointed, bf16, SDPA, expandable segments,
    full offload): reserved predicted against the run's measured maximum. The allocator slack under full
    offload (1.20) was calibrated on this run, so this holds the model to it rather than testing it;
    without expandable segments the slack is taken larger."""
    w, ran = _llama()
    assert w is not None
    layers = tuple(f"model.layers.{i}" for i in range(1, 20))
    config = Config(checkpoint=layers, precision="bf16", attention="sdpa", full_offload=True)
    config = dataclasses.replace(config, allocator=EXPANDABLE_SEGMENTS)
    p = predict(w, config)
    measured = ran["measured_max_reserved_bytes"]
    assert abs(p.reserved_bytes - measured) <= 0.05 * measured, (p.reserved_bytes, measured)
    assert p.peak_bytes >= ran["measured_max_allocated_bytes"], "allocated: not under the measured peak"
    bare = predict(w, dataclasses.replace(config, allocator=None))
    assert bare.reserved_bytes > p.reserved_bytes


def test_each_module_type_s_bf16_factor_is_what_gpt2_measured_net_of_its_weight_copies() -> None:
    """Per module type, the bytes GPT-2 saved under bf16 over fp32 (uncapped, H200), less the 16-bit
    weight copies the plan counts as autocast's cache, against the factor the plan uses. Conv1D had
    0.59, which counted its weight copies a second time."""
    saved: dict[str, dict[str, list[int]]] = {}
    for tag in ("fp32", "bf16"):
        trace = load_trace(DATA / f"gpu-gpt2-small-trainer-b16-s512-{tag}-uncapped.jsonl.gz")
        per = saved[tag] = collections.defaultdict(lambda: [0, 0])
        for r in layer_table(trace, peak_step(trace)):
            per[r["type"]][0] += r["activation_self_bytes"] or 0
            per[r["type"]][1] += r["param_bytes"] or 0
    for kind in ("Conv1D", "GPT2Attention", "NewGELUActivation", "LayerNorm", "Dropout"):
        fp32, params = saved["fp32"][kind]
        bf16 = saved["bf16"][kind][0] - params // 2
        assert abs(bf16 / fp32 - amp_factor(kind, "cuda")) < 0.02, kind


def test_full_offload_plan_measured_after_the_calibration_is_within_5_percent() -> None:
    """Session 8's plan (H100, 2026-12-07; a different checkpoint set from the one the slack was
    calibrated on: 17 layers and five sub-modules), predicted from the committed H200 profile, against
    what `memdoctor run` measured: reserved within 5%, allocated not under by more than 5%."""
    w, _ = _llama()
    assert w is not None
    raw = DATA.parent.parent / "benchmarks" / "results-h100-2026-12-07-session8.json"
    ran = json.loads(raw.read_text())["results"]["1.1B full offload"]
    config = Config(
        checkpoint=tuple(ran["checkpoint"]), precision="bf16", attention="sdpa", full_offload=True
    )
    p = predict(w, dataclasses.replace(config, allocator=EXPANDABLE_SEGMENTS))
    reserved, allocated = ran["run"]["max_reserved_bytes"], ran["run"]["max_allocated_bytes"]
    assert abs(reserved - p.reserved_bytes) <= 0.05 * p.reserved_bytes, (p.reserved_bytes, reserved)
    assert allocated <= 1.05 * p.peak_bytes, (p.peak_bytes, allocated)
