"""The doctor: the what-if model's arithmetic, the planner on recorded GPU traces, cards, nine-grid, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from memdoctor import exitcodes
from memdoctor.cards import CARDS, CONTEXT_RESERVE_BYTES, find_card
from memdoctor.cli import main
from memdoctor.errors import UsageError
from memdoctor.plan.alternatives import alternatives, every_n_baseline
from memdoctor.plan.checkpoints import choose_checkpoints
from memdoctor.plan.config import Config
from memdoctor.plan.memory import (
    AMP_ACTIVATION_FACTOR,
    CHECKPOINT_GRADIENT_SHARE,
    CHECKPOINT_RESERVED_RATIO,
    OPTIMIZER_STEP_TEMP_FACTOR,
)
from memdoctor.plan.model import predict, workload
from memdoctor.plan.ninegrid import ninegrid
from memdoctor.plan.planner import card_table, make_plan
from memdoctor.plan.target import SAFETY_MARGIN, Target, fits
from memdoctor.plan.timing import ACCUMULATION_FIXED_SHARE
from memdoctor.plan.workload import Candidate, Workload
from memdoctor.report import build_summary
from memdoctor.trace import Trace, load_trace
from tests.tracebuilder import GiB, MiB, completed_trace

DATA = Path(__file__).parent / "data"
BERT32 = DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"
BERT_OOM = DATA / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz"
GPT2 = DATA / "gpu-gpt2-small-trainer-b8-s512.jsonl.gz"


def _cand(name: str, index: int, free: int, ms: float, ancestors: tuple[int, ...] = ()) -> Candidate:
    return Candidate(name, 0, index, len(ancestors), free, ms, frozenset((0, a) for a in ancestors))


def hand_workload(**kw: Any) -> Workload:
    """Round numbers: peak 1000 = 100 params + 0 grads at the peak + 200 optimizer state + 600 activations
    + 50 temporaries + 50 fixed."""
    fields: dict[str, Any] = {
        "peak_bytes": 1000,
        "reserved_ratio": 1.0,
        "parameters": 100,
        "gradients_at_peak": 0,
        "gradients": 100,
        "optimizer_state": 200,
        "activations": 600,
        "temporaries": 50,
        "fixed": 50,
        "amp_share": 0.5,
        "matmul_param_bytes": 80,
        "step_ms": 100.0,
        "fwd_bwd_ms": 80.0,
        "compute_class": None,
        "batch_size": None,
        "complete": True,
        "candidates": [
            _cand("block", 1, 300, 10.0),
            _cand("block.inner", 2, 200, 4.0, (1,)),
            _cand("other", 3, 120, 6.0),
        ],
        "offload_bytes_per_s": None,
        "bf16_native": True,
        "precision_verdict": None,
    }
    fields.update(kw)
    return Workload(**fields)


@pytest.fixture(scope="module")
def bert32() -> tuple[Trace, dict[str, Any]]:
    trace = load_trace(BERT32)
    return trace, build_summary(trace)


# ----------------------------------------------------------------------------------------- memory model


def test_unchanged_config_predicts_the_measured_peak() -> None:
    p = predict(hand_workload(), Config())
    assert p.peak_bytes == 1000
    assert p.reserved_bytes == 1000
    assert p.extra_ms == 0 and p.time_ratio == 1.0


def test_unchanged_config_reproduces_a_recorded_trace_exactly(bert32: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert32
    w = workload(trace, summary)
    assert w is not None
    p = predict(w, Config())
    assert p.peak_bytes == summary["peak_memory_bytes"]
    step_alloc = max(trace.detailed_steps(), key=lambda s: s.memory["peak_bytes"]).memory["allocator"]
    assert p.reserved_bytes == pytest.approx(step_alloc["max_reserved"], abs=1)


def test_checkpointing_frees_the_chosen_modules_and_adds_back_the_largest() -> None:
    p = predict(hand_workload(), Config(checkpoint=("block", "other")))
    # acts 600 - (300 + 120) + max(300, 120) = 480; with checkpointing alone the backward peak holds
    # CHECKPOINT_GRADIENT_SHARE of the 100 gradient bytes
    assert p.breakdown["activations"] == 480
    assert p.breakdown["gradients"] == 100 * CHECKPOINT_GRADIENT_SHARE
    assert p.peak_bytes == 100 + 100 * CHECKPOINT_GRADIENT_SHARE + 200 + 480 + 50 + 50
    assert p.reserved_bytes == int(p.peak_bytes * CHECKPOINT_RESERVED_RATIO)  # the calibrated slack
    assert p.time_parts["recompute"] == pytest.approx(16.0)
    assert p.time_ratio == pytest.approx(1.16)


def test_nested_checkpoints_are_not_double_counted() -> None:
    outer = predict(hand_workload(), Config(checkpoint=("block",)))
    both = predict(hand_workload(), Config(checkpoint=("block", "block.inner")))
    assert both.breakdown["activations"] == outer.breakdown["activations"] == 600
    assert both.time_parts["recompute"] == outer.time_parts["recompute"] == 10.0


def test_micro_batch_scales_activations_and_temporaries_only() -> None:
    p = predict(hand_workload(), Config(accumulation_steps=2))
    assert p.breakdown == {
        "parameters": 100,
        "gradients": 100,
        "optimizer_state": 200,
        "activations": 300,
        "temporaries": 25,
        "fixed": 50,
        "autocast_weight_cache": 0,
    }
    assert p.time_ratio is None, "without a compute measurement the accumulation cost is unknown"
    assert any("unknown" in a for a in p.assumptions)


def test_accumulation_cost_follows_the_measured_compute_class() -> None:
    p = predict(hand_workload(compute_class="high"), Config(accumulation_steps=4))
    assert p.time_parts["accumulation"] == pytest.approx(80.0 * ACCUMULATION_FIXED_SHARE["high"] * 3)


def test_autocast_halves_the_matmul_share_and_caches_16_bit_weights() -> None:
    p = predict(hand_workload(), Config(precision="bf16"))
    assert p.breakdown["activations"] == int(600 * (1 - 0.5 * AMP_ACTIVATION_FACTOR))
    assert p.breakdown["autocast_weight_cache"] == 40
    assert p.breakdown["parameters"] == 100 and p.breakdown["optimizer_state"] == 200


def test_optimizer_levers() -> None:
    assert predict(hand_workload(), Config(optimizer="8bit")).breakdown["optimizer_state"] == 50
    off = predict(hand_workload(offload_bytes_per_s=1e3), Config(optimizer="offload"))
    assert off.breakdown["optimizer_state"] == 0
    assert off.time_parts["offload"] == pytest.approx(1e3 * 200 / 1e3)  # grads + params over 1 kB/s
    unknown = predict(hand_workload(), Config(optimizer="offload"))
    assert unknown.time_parts["offload"] is None and unknown.time_ratio is None


def test_model_state_floor_and_reserved_ratio() -> None:
    w = hand_workload(activations=10, temporaries=0, reserved_ratio=1.5)
    p = predict(w, Config(accumulation_steps=2))
    # the optimizer step's own peak: params + all gradients + state + fixed + foreach Adam's temporaries
    assert p.peak_bytes == 100 + 100 + 200 + 50 + 100 * OPTIMIZER_STEP_TEMP_FACTOR
    w2 = hand_workload(activations=0, temporaries=0, fixed=50, reserved_ratio=1.5)
    p2 = predict(w2, Config(optimizer="8bit"))
    assert p2.peak_bytes == 100 + 100 + 50 + 50
    assert p2.reserved_bytes == int(p2.peak_bytes * 1.5)


def test_unmeasured_optimizer_state_is_assumed_and_said() -> None:
    trace = load_trace(BERT_OOM)
    w = workload(trace, build_summary(trace))
    assert w is not None and not w.complete
    assert w.optimizer_state == 2 * w.parameters
    assert any("optimizer state not measured" in n for n in w.notes)
    assert any("blocks ran" in n for n in w.notes), "the blocks that never ran are extrapolated, and said so"
    assert w.activations > 2 * build_summary(trace)["categories"]["activations"]


# ----------------------------------------------------------------------------------------- planner


def test_checkpoint_choice_never_nests_and_prefers_bytes_per_ms() -> None:
    w = hand_workload()
    # checkpointing alone: half the gradients (50) + params 100 + state 200 + temporaries 50 + fixed 50 =
    # 450 besides the activations, reserved = allocated x 1.15. At 1100 the allocated limit is 956.5, so
    # the 600 activation bytes must lose >= 93.5 net. Net = sum - max: {block.inner, other} frees 120 for
    # 10 ms, {block, other} 120 for 16 ms; the nested pair is not allowed
    assert CHECKPOINT_GRADIENT_SHARE == 0.5 and CHECKPOINT_RESERVED_RATIO == 1.15
    target = Target(1100, margin=0.0)
    chosen = choose_checkpoints(w, Config(), target)
    assert {c.name for c in chosen} == {"block.inner", "other"}
    assert fits(predict(w, Config(checkpoint=tuple(c.name for c in chosen))), target)
    # at 975 the limit is 847.8: >= 202 net would have to go
    assert choose_checkpoints(w, Config(), Target(975, margin=0.0)) == [], "no choice frees 200 net"


def test_bert_fp32_at_8gib_checkpoints_encoder_layers(bert32: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = bert32
    w = workload(trace, summary)
    assert w is not None
    target = Target(8 * GiB)
    plan = make_plan(w, target)
    assert plan.fits and not plan.fits_as_is
    assert plan.chosen is not None
    assert plan.chosen.reserved_bytes <= 8 * GiB * (1 - SAFETY_MARGIN)
    assert all(n.startswith("bert.encoder.layer.") for n in plan.chosen.config.checkpoint)
    # Checkpointing alone (full batch, fp32): encoder layers only, and less recomputation than the
    # hand-tuning rule "every N-th layer" for the same budget.
    from memdoctor.plan.checkpoints import choose_checkpoints
    from memdoctor.plan.config import Config

    chosen = choose_checkpoints(w, Config((), 1, "fp32", "as-is"), target)
    assert chosen and all(c.name.startswith("bert.encoder.layer.") for c in chosen)
    baseline = every_n_baseline(trace, w, target)
    assert baseline is not None and baseline.extra_ms is not None
    assert sum(c.forward_ms for c in chosen) < baseline.extra_ms


def test_gpt2_plan_beats_every_n() -> None:
    trace = load_trace(GPT2)
    w = workload(trace, build_summary(trace))
    assert w is not None
    target = Target(8 * GiB)
    plan = make_plan(w, target)
    base = every_n_baseline(trace, w, target)
    assert plan.chosen is not None and base is not None
    assert plan.chosen.extra_ms is not None and base.extra_ms is not None
    assert plan.chosen.extra_ms < base.extra_ms
    assert all(n.startswith("transformer.h.") for n in plan.chosen.config.checkpoint)


def test_oom_trace_still_gets_a_plan_with_caveats() -> None:
    trace = load_trace(BERT_OOM)
    w = workload(trace, build_summary(trace))
    assert w is not None
    plan = make_plan(w, Target(8 * GiB))
    assert plan.fits and plan.chosen is not None
    assert not any(n.startswith("bert.embeddings") for n in plan.chosen.config.checkpoint)
    assert any("died" in a for a in plan.advice)
    assert plan.as_dict()["measured_peak_bytes"] == w.peak_bytes


def test_nothing_fits_says_so_and_what_would(bert32: tuple[Trace, dict[str, Any]]) -> None:
    w = workload(*bert32)
    assert w is not None
    plan = make_plan(w, Target(GiB // 4))  # under 1 GiB full offload (FSDP2) fits BERT-base b32
    d = plan.as_dict()
    assert d["fits"] is False
    assert d["advice"][0].startswith("nothing modelled fits")
    assert any("card" in a for a in d["advice"])


def test_numerics_levers_only_when_memory_levers_do_not_suffice(bert32: tuple[Trace, dict[str, Any]]) -> None:
    """Without native bf16, fp16 and the 8-bit optimizer come only when nothing else fits; with native
    bf16 (the H200 the trace was profiled on) bf16 autocast is in the first tier and, predicted faster,
    is chosen, while the plan alternatives keep the fastest fp32 config."""
    w = workload(*bert32)
    assert w is not None
    no_bf16 = dataclasses.replace(w, bf16_native=False)
    for gib in (8, 6, 4):
        chosen = make_plan(no_bf16, Target(gib * GiB)).chosen
        assert chosen is not None
        assert chosen.config.precision == "fp32" and chosen.config.optimizer != "8bit"
    assert w.bf16_native
    plan = make_plan(w, Target(8 * GiB))
    assert plan.chosen is not None and plan.chosen.config.precision == "bf16"
    kept = alternatives(w, Target(8 * GiB), plan)["numerics_preserving"]
    assert kept is not None and kept["config"]["precision"] == "fp32" and kept["fits"]


def test_card_table_answers_which_card(bert32: tuple[Trace, dict[str, Any]]) -> None:
    w = workload(*bert32)
    assert w is not None
    rows = {r["card"]: r for r in card_table(w)}
    assert len(rows) == len(CARDS)
    assert rows["GeForce RTX 2070"]["verdict"] == "fits with plan"
    assert rows["GeForce RTX 2070"]["levers"]
    assert rows["A100 80GB"]["verdict"] == "fits as-is"
    tiny = hand_workload(parameters=10 * 1024 * GiB, peak_bytes=10 * 1024 * GiB)
    assert {r["verdict"] for r in card_table(tiny)} == {"does not fit"}


# ----------------------------------------------------------------------------------------- cards


def test_cards_are_found_by_loose_names() -> None:
    assert find_card("RTX 2070").key == "rtx2070"
    assert find_card("a100").key == "a100-40gb"
    assert find_card("NVIDIA H100-80GB").key == "h100-80gb"
    card = find_card("t4")
    assert not card.bf16 and card.pcie_gen == 3
    assert card.usable_bytes == 16 * GiB - CONTEXT_RESERVE_BYTES
    with pytest.raises(UsageError, match="rtx2070"):
        find_card("rtx9999")


def test_every_required_card_is_listed() -> None:
    keys = {c.key for c in CARDS}
    for k in ("rtx2070", "rtx2080ti", "rtx3060", "rtx3090", "rtx4090", "t4", "v100-16gb", "v100-32gb"):
        assert k in keys
    for k in ("a10", "l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200"):
        assert k in keys
    assert all(c.bf16 == (c.capability >= (8, 0)) for c in CARDS)


# ----------------------------------------------------------------------------------------- nine-grid, summary


def test_ninegrid_levels_and_unmeasured_axes() -> None:
    summary = {
        "compute": {"class": "high", "arithmetic_intensity": 300.0, "roofline": {"ridge_point": 200.0}},
        "data": {"traits": {"level": "medium", "class": "dynamic shapes", "evidence": "2 shapes"}},
        "padding_fraction": 0.2,
    }
    grid = ninegrid(summary, hand_workload(), 1000)
    assert grid["compute"]["level"] == "high"
    assert grid["parameter_scale"]["level"] == "medium"  # 400 / 1000
    assert grid["parameter_scale"]["figures"]["model_state_bytes"] == 400
    assert grid["data"]["level"] == "medium"
    assert ninegrid(summary, hand_workload(), 10_000)["parameter_scale"]["level"] == "low"
    assert ninegrid(summary, hand_workload(), 500)["parameter_scale"]["level"] == "high"
    empty = ninegrid({}, None, None)
    assert all(axis["level"] is None and axis["evidence"] for axis in empty.values())


def test_summary_gains_plan_keys(bert32: tuple[Trace, dict[str, Any]]) -> None:
    _, summary = bert32
    assert summary["plan"]["fits_as_is"] is True  # the H200 it ran on
    assert summary["plan"]["budget_bytes"] == summary["device"]["total_memory_bytes"] - CONTEXT_RESERVE_BYTES
    # heavy padding (37.7%): the nine-grid cell puts dynamic padding first, then checkpointing
    assert [f["rule"] for f in summary["findings"]][:2] == ["dynamic_padding", "checkpointing"]
    assert summary["lever_priority"]["order"][:2] == ["padding", "checkpoint"]
    assert set(summary["ninegrid"]) == {"compute", "parameter_scale", "data"}
    oom = build_summary(load_trace(BERT_OOM))
    assert oom["plan"]["budget_bytes"] == 8 * GiB and oom["plan"]["fits_as_is"] is False


def test_cpu_trace_without_budget_has_no_plan() -> None:
    summary = build_summary(completed_trace(kind="cpu", budget_bytes=None, layers=2))
    assert summary["plan"] is None
    assert summary["ninegrid"]["parameter_scale"]["level"] is None
    assert isinstance(summary["findings"], list)


# ----------------------------------------------------------------------------------------- CLI


def test_cli_plan_for_a_card(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(BERT32), "--gpu", "rtx2070"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "fits with: checkpoint" in out and "which cards, and how many" in out


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(BERT32), "--budget", "6GiB", "--json"]) == exitcodes.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["budget_bytes"] == 6 * GiB
    assert doc["plan"]["predicted_reserved_bytes"] <= doc["plan"]["limit_bytes"]
    assert len(doc["cards"]) == len(CARDS)


def test_cli_plan_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", str(BERT32), "--gpu", "rtx9999"]) == exitcodes.USAGE_ERROR
    assert "unknown GPU" in capsys.readouterr().err
    # --gpu with --budget is allowed (the smaller memory, the card's features: tests/test_plan_card.py)
    assert main(["plan", str(BERT32), "--budget", "lots"]) == exitcodes.USAGE_ERROR
    assert main(["plan", str(tmp_path / "missing.jsonl.gz")]) == exitcodes.TRACE_ERROR
    cpu = completed_trace(kind="cpu", budget_bytes=None, layers=2)
    path = tmp_path / "cpu.jsonl.gz"
    from memdoctor.trace import save_trace

    save_trace(cpu, path)
    capsys.readouterr()
    assert main(["plan", str(path)]) == exitcodes.USAGE_ERROR
    assert "--budget SIZE or --gpu NAME" in capsys.readouterr().err
    assert main(["plan", str(path), "--budget", str(64 * MiB)]) == exitcodes.OK


# ----------------------------------------------------------------------------------------- report


def test_report_section_carries_the_plan_and_the_card_table(bert32: tuple[Trace, dict[str, Any]]) -> None:
    from memdoctor.report.sections import report_sections

    trace, summary = bert32
    (plan,) = [s for s in report_sections(trace, summary) if s["name"] == "plan"]
    assert plan["template"] == "sections/plan.html.j2"
    assert len(plan["ctx"]["cards"]) == len(CARDS)
    assert plan["ctx"]["plan"] == summary["plan"]


def test_report_renders_the_plan_section_with_and_without_a_plan(tmp_path: Path) -> None:
    from memdoctor.report import write_report

    for name, trace in (
        ("gpu", load_trace(BERT_OOM)),
        ("cpu", completed_trace(kind="cpu", budget_bytes=None)),
    ):
        (tmp_path / name).mkdir()
        html = Path(write_report(trace, tmp_path / name)["report"]).read_text()
        assert 'id="plan"' in html
        assert ("No plan: no budget" in html) == (name == "cpu")


def test_a_fit_only_an_8bit_optimizer_gives_is_advice_not_the_plan() -> None:
    """The real pytorch/examples imagenet on CPU: only an 8-bit optimizer fitted, and the plan proposed
    it although ``memdoctor run`` refuses to swap the script's own optimizer. Such a config is now
    advice naming what the script must change, and the plan says nothing ``run`` can apply fits."""
    w = hand_workload(
        candidates=[],
        device_kind="cpu",
        bf16_native=False,
        optimizer_classes=("AdamW",),
        batch_size=1,
        optimizer_state=600,
        activations=200,
    )
    assert predict(w, Config(optimizer="8bit")).reserved_bytes <= Target(800).limit_bytes
    plan = make_plan(w, Target(800))
    assert plan.chosen is None
    assert plan.closest.config.optimizer != "8bit"
    assert any("AdamW8bit" in a and "would fit" in a for a in plan.advice)
