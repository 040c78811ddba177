"""The script's own precision, from hand-built traces: what the analysis says about it, and a what-if
model that starts from it (no saving from autocast that is already on, no halving of 16-bit
activations, no autocast proposed to a script that runs its own)."""

from __future__ import annotations

from typing import Any

import pytest

from memdoctor.analysis.precision import dtype_label, script_precision
from memdoctor.analysis.summary import not_measured
from memdoctor.config.from_plan import from_plan
from memdoctor.plan import rules as R
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.model import predict
from memdoctor.plan.target import Target
from memdoctor.plan.tiers import tier_one, tier_two
from memdoctor.plan.timing import (
    AMP_OTHER_TIME_FACTOR,
    AMP_TENSOR_EFFICIENCY,
    TF32_OVER_16BIT,
    amp_time_factor,
)
from memdoctor.report import build_summary
from memdoctor.trace import Trace
from tests.test_plan import hand_workload
from tests.tracebuilder import GiB, TraceBuilder, tiny_mlp

MLP = tiny_mlp(width=256, depth=3)  # Linear / ReLU pairs: every module is matmul-type or an activation


def _trace(autocast: str | None, outputs: str = "float32", params: dict[str, int] | None = None) -> Trace:
    """A tiny MLP's trace; with ``autocast`` the precision collector's fields say every module forward
    ran under it (``None``: the collector did not run at all)."""
    b = TraceBuilder(kind="cuda", budget_bytes=8 * GiB)
    b.add_model(MLP)
    b.add_steps(warmup=1, profiled=2)
    b.end("completed")
    trace = b.build()
    if autocast is None:
        return trace
    n = len(MLP)
    state = "off" if autocast == "off" else autocast
    bits = {"off": 0, "bfloat16": 16, "float16": 16}
    for step in trace.steps:
        step.collectors["precision"] = {
            "device_type": "cuda",
            "forwards": n,
            "autocast_forwards": {} if state == "off" else {state: n},
            "output_bytes": {outputs: 4096},
            "parameter_bytes": params or {"float32": 1000},
            "tf32": {"matmul": False, "cudnn": True, "float32_matmul_precision": "high"},
        }
        step.modules[0]["autocast_bits"] = [bits[state]] * n
        step.modules[0]["output_bits"] = [32 if outputs == "float32" else 16] * n
    return trace


def _workload(trace: Trace) -> Any:
    w = measured_workload(trace, build_summary(trace))
    assert w is not None
    return w


def test_the_summary_says_what_precision_the_script_runs_in() -> None:
    p = script_precision(_trace("bfloat16", outputs="bfloat16"))
    assert p is not None
    assert p["autocast"] == "bf16" and p["autocast_share"] == 1.0
    assert p["parameters"] == "fp32"
    assert p["activation_16bit_share"] == 1.0
    assert p["tf32"]["matmul_tf32"] is True  # float32_matmul_precision "high" allows TF32
    assert p["text"].startswith("runs under its own bf16 autocast (100% of module forwards); parameters fp32")
    assert "TF32 on (matmuls and cuDNN)" in p["text"]
    off = script_precision(_trace("off"))
    assert off is not None and off["autocast"] is None and off["text"].startswith("runs without autocast")
    assert script_precision(_trace(None)) is None  # not measured: no claim
    assert build_summary(_trace("bfloat16"))["script_precision"]["autocast"] == "bf16"
    applied = _trace("bfloat16")
    applied.header["applied_config"] = {"memdoctor_config": 1, "precision": "bf16"}
    text = (script_precision(applied) or {})["text"]
    assert "own" not in text and "memdoctor's applied config asks for it" in text


def test_parameter_dtypes_are_labelled_by_bytes() -> None:
    assert dtype_label({"float64": 80}) == "fp64"
    assert dtype_label({"float32": 300, "bfloat16": 100}) == "mixed (fp32 75%, bf16 25%)"
    assert dtype_label({}) is None


def test_a_script_under_its_own_bf16_autocast_has_nothing_left_for_autocast_to_halve() -> None:
    fp32 = _workload(_trace("off"))
    bf16 = _workload(_trace("bfloat16", outputs="bfloat16"))
    assert fp32.amp_share > 0.9 and fp32.matmul_param_bytes > 0 and fp32.script_autocast is None
    assert bf16.amp_share == 0.0 and bf16.matmul_param_bytes == 0
    assert bf16.script_autocast == "bf16" and "bf16 autocast" in (bf16.script_precision or "")


def test_16bit_outputs_without_autocast_are_not_halved_again() -> None:
    """A model cast to bf16 (``model.bfloat16()``) runs no autocast, but its activations are 16-bit."""
    w = _workload(_trace("off", outputs="bfloat16", params={"bfloat16": 1000}))
    assert w.script_autocast is None
    assert w.amp_share == 0.0
    assert w.matmul_param_bytes == 0  # no fp32 weights to cache a 16-bit copy of


def test_unmeasured_precision_is_assumed_fp32_and_said() -> None:
    w = _workload(_trace(None))
    assert w.amp_share == _workload(_trace("off")).amp_share  # the same as a measured fp32 run
    assert any("precision was not measured" in n for n in w.notes)


def test_autocast_already_on_predicts_no_saving_no_weight_cache_and_no_time() -> None:
    own = hand_workload(script_autocast="bf16", script_precision="runs under its own bf16 autocast")
    same, bf16 = (
        predict(own, Config(checkpoint=("block",))),
        predict(own, Config(checkpoint=("block",), precision="bf16")),
    )
    assert bf16.peak_bytes == same.peak_bytes
    assert "autocast_weight_cache" not in bf16.breakdown or bf16.breakdown["autocast_weight_cache"] == 0
    assert bf16.extra_ms == same.extra_ms
    assert any("already runs under its own bf16 autocast" in a for a in bf16.assumptions)
    fresh = predict(hand_workload(), Config(checkpoint=("block",), precision="bf16"))
    assert fresh.peak_bytes < predict(hand_workload(), Config(checkpoint=("block",))).peak_bytes


def test_no_autocast_is_proposed_to_a_script_that_runs_its_own() -> None:
    target = Target(8 * GiB)
    own = hand_workload(script_autocast="bf16")
    assert {c.precision for c in tier_one(own, target)} == {"fp32"}
    assert {c.precision for c in tier_two(own, target)} <= {"fp32"}
    assert "bf16" in {c.precision for c in tier_one(hand_workload(), target)}
    fp16_card = hand_workload(script_autocast="fp16", bf16_native=False, precision_verdict="fp16_safe")
    assert {c.precision for c in tier_two(fp16_card, target)} == {"fp32"}


def test_the_mixed_precision_finding_says_already_with_nothing_to_save() -> None:
    trace = _trace("bfloat16", outputs="bfloat16")
    summary = build_summary(trace)
    x = R.RuleInput(trace, summary, _workload(trace), Target(8 * GiB))
    (found,) = R.mixed_precision(x)
    assert found["title"] == "already trains under its own bf16 autocast"
    assert found["saving_bytes"] == 0


def test_a_failed_collector_is_in_not_measured() -> None:
    b = TraceBuilder(kind="cuda")
    b.add_model(MLP)
    b.add_steps(warmup=1, profiled=1)
    b.add_event("collector_failed", "the histograms collector failed and was switched off: ValueError: x")
    b.end("completed")
    notes = not_measured(b.build())
    assert "the histograms collector failed and was switched off: ValueError: x" in notes


def test_tf32_on_shrinks_what_autocast_gains() -> None:
    """H200: fp32 67, bf16 989 TFLOP/s dense; TF32 runs fp32 matmuls at half the bf16 rate."""
    fp32 = hand_workload(device_name="NVIDIA H200", peak_fraction=0.06, compute_class="high")
    tf32 = hand_workload(
        device_name="NVIDIA H200", peak_fraction=0.06, compute_class="high", script_tf32=True
    )
    plain, _ = amp_time_factor(fp32, "bf16")
    with_tf32, why = amp_time_factor(tf32, "bf16")
    # the matmul share is the same measured FLOP rate over the faster TF32 peak: smaller
    share = 0.06 * 67 / (989 * TF32_OVER_16BIT) * 100.0 / 80.0
    speedup = 1 / TF32_OVER_16BIT * AMP_TENSOR_EFFICIENCY  # 1.0: no faster than TF32
    expected = share / max(speedup, 1.0) + (1 - share) * AMP_OTHER_TIME_FACTOR
    assert with_tf32 == pytest.approx(expected)
    assert with_tf32 > plain and "TF32 (on in the script)" in why


def test_tf32_is_read_from_a_cuda_run_only() -> None:
    assert _workload(_trace("off")).script_tf32 is True  # "high" float32 matmul precision
    cpu = _trace("off")
    for step in cpu.steps:
        step.collectors["precision"]["device_type"] = "cpu"
    assert _workload(cpu).script_tf32 is None


def test_memdoctor_yaml_says_bf16_where_the_plan_keeps_the_scripts_bf16() -> None:
    plan = {"config": Config(checkpoint=("block",)).as_dict(), "script_autocast": "bf16"}
    assert from_plan(plan).precision == "bf16"
    assert from_plan({**plan, "script_autocast": None}).precision == "fp32"
    # fp16 stays fp32 in the file: its fp16 would bring memdoctor's loss scaling beside the script's own
    fp16 = from_plan({**plan, "script_autocast": "fp16"})
    assert fp16.precision == "fp32" and fp16.grad_scaler is None
