"""The planner for several GPUs (issue 17, point 4): per-rank memory under DDP, FSDP2 (with and without
resharding after forward, with CPU offload), the communication time over the measured or published
link, the search over N cards, "N are not enough, M are", a rank's trace planned from its one-process
equivalent, and ``--gpus 1`` as before. On hand-built workloads and the recorded traces."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from memdoctor.cards import LINK_EFFICIENCY, find_card
from memdoctor.cli import main
from memdoctor.config import config_for_summary, dump_config, parse_config
from memdoctor.plan.comm import GLOO_CPU_BYTES_PER_S, moved_bytes
from memdoctor.plan.config import Config
from memdoctor.plan.model import predict, workload
from memdoctor.plan.parallel import from_rank, spread
from memdoctor.plan.planner import card_table, gpus_needed, make_plan
from memdoctor.plan.splits import Split
from memdoctor.plan.summarize import doctor, ranks_target
from memdoctor.plan.target import Target, fits
from memdoctor.plan.workload import Workload
from memdoctor.report import build_summary
from memdoctor.trace import Trace, load_trace
from tests.test_plan import hand_workload
from tests.tracebuilder import GiB, MiB

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "data"
BERT32 = DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"  # H200, fp32, 12 BertLayer blocks
LLAMA = DATA / "accuracy" / "llama-profile.jsonl.gz"  # H200, a 0.95B decoder, 16 blocks
TINY = DATA / "cpu-tiny-bert-plain-loop-b4.jsonl.gz"  # CPU, batch 4


def _recorded(path: Path) -> tuple[Trace, dict[str, Any], Workload]:
    trace = load_trace(path)
    summary = build_summary(trace)
    w = workload(trace, summary)
    assert w is not None
    return trace, summary, w


@pytest.fixture(scope="module")
def bert() -> tuple[Trace, dict[str, Any], Workload]:
    return _recorded(BERT32)


def _blocks(**kw: Any) -> Workload:
    """``hand_workload`` (P 100, G 100, O 200, A 600, T 50, fixed 50) with 4 shard units (85 of the 100
    parameter bytes; the root's own 15) and a batch of 8."""
    units = {"shard_units": (20, 20, 20, 25), "shard_names": ("b.0", "b.1", "b.2", "b.3"), "batch_size": 8}
    return hand_workload(**{**units, **kw})


def _fsdp(n: int, engine: str = "fsdp2", **kw: Any) -> Config:
    return Config(gpus=n, parallel=engine, shard_modules=("b.0", "b.1", "b.2", "b.3"), **kw)


# ----------------------------------------------------------------------------------------- memory


def test_ddp_rank_holds_the_state_a_share_of_the_activations_and_the_buckets() -> None:
    w = _blocks()
    p = predict(w, Config(gpus=2, parallel="ddp"))
    assert p.breakdown["parameters"] == 100 and p.breakdown["optimizer_state"] == 200
    assert p.breakdown["activations"] == 300 and p.breakdown["temporaries"] == 25  # the batch / 2
    assert p.breakdown["gradient_buckets"] == 100  # one more copy of the gradients
    assert p.breakdown["gradients"] == 0  # as measured at the peak: the step keeps its shape
    assert p.peak_bytes == 100 + 200 + 300 + 25 + 50 + 100
    assert any("gradient_as_bucket_view=False" in a for a in p.assumptions)


def test_ddp_on_a_recorded_trace_is_the_measured_peak_with_half_the_activations_plus_buckets(
    bert: tuple[Trace, dict[str, Any], Workload],
) -> None:
    _, _, w = bert
    for n in (2, 4):
        p = predict(w, Config(gpus=n, parallel="ddp"))
        share = math.ceil(w.batch_size / n) / w.batch_size  # type: ignore[operator]
        moved = w.activations - int(w.activations * share) + w.temporaries - int(w.temporaries * share)
        assert p.peak_bytes == w.peak_bytes - moved + w.gradients
        assert p.breakdown["gradient_buckets"] == w.gradients


def test_fsdp2_divides_the_state_by_n_and_peaks_where_the_activations_meet_the_gathered_units() -> None:
    w = _blocks()
    for n in (2, 4):
        p = predict(w, _fsdp(n))
        assert p.breakdown["parameters"] == math.ceil(100 / n)
        assert p.breakdown["optimizer_state"] == math.ceil(200 / n)
        assert p.breakdown["activations"] == 600 // n
        # The last unit's backward starts: the root's parameters and gradients, that unit and the
        # previous one (prefetched) gathered, no gradient reduced yet, every activation but the loss's.
        assert p.breakdown["unsharded_parameters"] == 15 + 25 + 20
        assert p.breakdown["unsharded_gradients"] == 15
        assert p.breakdown["gradients"] == 0
        assert "gradient_buckets" not in p.breakdown
        assert any("peaks at the backward start of shard unit 4 of 4" in a for a in p.assumptions)
    kept = predict(w, _fsdp(2, "fsdp2-no-reshard"))
    # The forward end: every unit gathered, and the last one's all-gather output not yet freed.
    assert kept.breakdown["unsharded_parameters"] == 100 + 25
    root_only = predict(w, Config(gpus=2, parallel="fsdp2"))  # no shard_modules: the root holds all
    assert root_only.breakdown["unsharded_parameters"] == 100
    assert root_only.breakdown["unsharded_gradients"] == 100


def test_fsdp2_with_few_activations_peaks_late_in_backward() -> None:
    """A peak in the optimizer step (few activations there, every gradient) moves under FSDP2: the
    state is halved, and the rank peaks late in backward, as a unit's backward ends: the reduced
    gradients pile up beside its own unsharded gradients, the previous unit's reduce-scatter input,
    and two units gathered (every unit not yet back-propagated without resharding)."""
    w = _blocks(activations=0, gradients_at_peak=100, forward_end_activations=40, forward_end_gradients=0)
    p = predict(w, _fsdp(2))
    assert any("peaks at the backward end of shard unit 3 of 4" in a for a in p.assumptions)
    assert p.breakdown["gradients"] == math.ceil(25 / 2)  # the last unit's, reduced and sharded
    assert p.breakdown["activations"] == 40 // 2 * 2 // 4  # the forward end's, of the 2 units left
    assert p.breakdown["unsharded_parameters"] == 15 + 20 + 20  # the root, unit 3 and unit 2
    assert p.breakdown["unsharded_gradients"] == 15 + 20 + 25  # the root's, unit 3's, unit 4's input
    kept = predict(w, _fsdp(2, "fsdp2-no-reshard"))
    assert any("peaks at the backward end of shard unit 3 of 4" in a for a in kept.assumptions)
    assert kept.breakdown["unsharded_parameters"] == 15 + 3 * 20  # units 1-3 still gathered


def test_fsdp2_with_cpu_offload_holds_what_one_process_does_under_full_offload() -> None:
    w = _blocks(offload_bytes_per_s=1e3)
    one = predict(w, Config(full_offload=True))
    two = predict(w, _fsdp(2, full_offload=True))
    assert two.breakdown["parameters"] == one.breakdown["parameters"]
    assert two.breakdown["optimizer_state"] == 0
    assert two.breakdown["activations"] == one.breakdown["activations"] // 2


def test_fsdp2_on_the_recorded_decoder_fits_where_ddp_does_not() -> None:
    """The 0.95B decoder (3.55 GiB of fp32 parameters, 7.1 GiB of AdamW state) on 2 x 16 GiB: DDP
    keeps the whole state per card, FSDP2 half of it; the planner picks FSDP2."""
    _, _, w = _recorded(LLAMA)
    target = Target(16 * GiB, gpus=2)
    ddp = predict(w, Config(gpus=2, parallel="ddp"))
    assert not fits(ddp, target)
    plan = make_plan(w, target)
    assert plan.chosen is not None and plan.chosen.config.parallel in ("fsdp2", "fsdp2-no-reshard")
    assert plan.chosen.config.gpus == 2 and len(plan.chosen.config.shard_modules) == 16
    assert plan.as_dict()["gpus"] == 2 and plan.as_dict()["config"]["parallel"] == plan.chosen.config.parallel


def test_the_planner_picks_fsdp2_when_ddp_does_not_fit() -> None:
    w = _blocks(activations=100, peak_bytes=500)  # state-heavy: 400 of state, 100 of activations
    target = Target(560, gpus=4)  # limit 504: DDP's state + buckets alone is 500
    assert not fits(predict(w, Config(gpus=4, parallel="ddp")), target)
    plan = make_plan(w, target)
    assert plan.chosen is not None and plan.chosen.config.parallel in ("fsdp2", "fsdp2-no-reshard")
    assert plan.chosen.config.gpus == 4 and not plan.fits_as_is


# ----------------------------------------------------------------------------------------- time


def test_ddp_communication_is_an_all_reduce_of_the_gradients_over_the_measured_link() -> None:
    w = _blocks(link_bytes_per_s=1e3, link_backend="nccl", link_world_size=2)
    p = predict(w, Config(gpus=2, parallel="ddp"))
    assert p.time_parts["communication"] == pytest.approx(1e3 * 2 * (1 / 2) * 100 / 1e3)
    assert p.time_basis["communication"].startswith("measured: nccl")
    assert moved_bytes(w, Config(gpus=4, parallel="ddp", accumulation_steps=2)) == {
        "all_reduce": 2 * 0.75 * 100 * 2
    }


def test_fsdp2_moves_the_parameters_once_more_when_it_reshards() -> None:
    w = _blocks()
    reshard = moved_bytes(w, _fsdp(2))
    kept = moved_bytes(w, _fsdp(2, "fsdp2-no-reshard"))
    assert reshard == {"all_gather": 0.5 * (100 + 85), "reduce_scatter": 0.5 * 100}
    assert kept == {"all_gather": 0.5 * 100, "reduce_scatter": 0.5 * 100}


def test_link_rates_are_labelled_measured_published_or_assumed() -> None:
    cpu = predict(_blocks(device_kind="cpu"), Config(gpus=2, parallel="ddp"))
    assert cpu.time_parts["communication"] == pytest.approx(1e3 * 100 / GLOO_CPU_BYTES_PER_S)
    assert cpu.time_basis["communication"].startswith("assumption: gloo")
    h100 = find_card("h100")
    named = predict(_blocks(), Config(gpus=2, parallel="ddp"), card_name=h100.name)
    assert named.time_parts["communication"] == pytest.approx(1e3 * 100 / (450e9 * LINK_EFFICIENCY))
    assert "published" in named.time_basis["communication"] and "NVLink" in named.time_basis["communication"]
    pcie = predict(_blocks(), Config(gpus=2, parallel="ddp"), card_name=find_card("rtx2070").name)
    assert "PCIe Gen3" in pcie.time_basis["communication"]
    unknown = predict(_blocks(device_kind="cuda"), Config(gpus=2, parallel="ddp"))
    assert unknown.time_parts["communication"] is None and unknown.extra_ms is None


def test_a_rank_computes_its_share_of_the_batch_and_fsdp2_its_share_of_the_optimizer() -> None:
    w = _blocks(compute_class="high", optimizer_ms=8.0, device_kind="cpu")
    p = predict(w, _fsdp(2))
    assert p.time_parts["data_parallel"] == pytest.approx(80.0 * (0.12 + 0.88 / 2 - 1.0))
    assert p.time_parts["sharded_optimizer"] == pytest.approx(-4.0)
    assert "not overlapped" in " ".join(p.assumptions)
    assert p.time_ratio is not None and p.time_ratio < 1.0


# ----------------------------------------------------------------------------------------- the search


def test_spread_leaves_out_what_an_engine_replaces_and_splits_that_do_not_divide_a_rank_batch() -> None:
    w = _blocks(batch_size=6)
    configs = [
        Config(),
        Config(accumulation_steps=2),
        Config(accumulation_steps=3),  # a rank's batch is 3 over 2 GPUs
        Config(optimizer="offload"),
        Config(optimizer="8bit"),
        Config(full_offload=True),
    ]
    out = spread(w, 2, configs)
    assert {
        (c.accumulation_steps, c.parallel) for c in out if c.optimizer == "as-is" and not c.full_offload
    } == {
        (1, "ddp"),
        (1, "fsdp2"),
        (1, "fsdp2-no-reshard"),
        (3, "ddp"),
        (3, "fsdp2"),
        (3, "fsdp2-no-reshard"),
    }
    assert [c.parallel for c in out if c.optimizer == "8bit"] == ["ddp"]
    assert [c.parallel for c in out if c.full_offload] == ["fsdp2"]
    assert all(c.gpus == 2 for c in out) and spread(w, 1, configs) == configs


def test_n_not_enough_says_how_many_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--budget", "2.2MiB", "--gpus", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert not plan["fits"] and plan["gpus"] == 2
    assert plan["advice"][0].startswith("2 GPUs are not enough: 3 are, with ")
    assert plan["gpus_needed"]["gpus"] == 3
    assert any("over 3 GPUs" in lever for lever in plan["gpus_needed"]["levers"])
    assert main(["plan", str(TINY), "--budget", "1MiB", "--gpus", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["advice"][0] == "2 GPUs are not enough, and no plan on up to 4 fits either"  # batch of 4


def test_more_gpus_than_samples_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY), "--budget", "8GiB", "--gpus", "8"]) == 2
    assert "batch of 4 samples cannot be split over 8 GPUs" in capsys.readouterr().err


def test_gpus_needed_is_the_fewest_cards_that_fit(bert: tuple[Trace, dict[str, Any], Workload]) -> None:
    _, _, w = bert
    target = Target(GiB)
    found = gpus_needed(w, target)
    assert found is not None and found.chosen is not None
    fewer = [m for m in (2, 3, 4, 6, 8, 12, 16) if m < found.target.gpus]
    assert all(not make_plan(w, dataclasses.replace(target, gpus=m)).fits for m in fewer)


def test_the_card_table_says_how_many_of_each_card(bert: tuple[Trace, dict[str, Any], Workload]) -> None:
    """An activation-heavy step no lever shrinks on one card (no split applies, nothing to checkpoint):
    40 GiB of activations; on N cards each holds 1/N of them."""
    big = _blocks(
        parameters=GiB,
        gradients=GiB,
        optimizer_state=2 * GiB,
        activations=40 * GiB,
        temporaries=0,
        fixed=0,
        peak_bytes=44 * GiB,
        shard_units=(GiB // 8,) * 8,
        shard_names=tuple(f"b.{i}" for i in range(8)),
        candidates=[],
        split=Split(None, why_not="no split applies"),
    )
    rows = {r["gpu"]: r for r in card_table(big)}
    assert rows["rtx2070"]["verdict"] == "does not fit" and rows["rtx2070"]["gpus"] == 1
    needed = rows["rtx2070"]["gpus_needed"]
    assert needed is not None and needed["gpus"] == 8 and needed["levers"]  # 5 GiB of activations each
    assert rows["h200"]["verdict"] == "fits as-is" and rows["h200"]["gpus_needed"] is None
    _, _, w = bert
    two = {r["gpu"]: r for r in card_table(w, gpus=2)}
    assert all(r["gpus"] == 2 for r in two.values())
    assert any("over 2 GPUs" in lever for lever in two["rtx2070"]["levers"])


# ----------------------------------------------------------------------------------------- --gpus 1


def test_one_gpu_plans_as_before(
    bert: tuple[Trace, dict[str, Any], Workload], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpus 1`` is the one-process planner: no engine is ever proposed, and the plan is the same
    with and without the flag (the recorded plans of the other test files pin its values)."""
    _, _, w = bert
    for budget in (2, 4, 8, 16):
        plan = make_plan(w, Target(budget * GiB))
        assert plan.as_dict()["gpus"] == 1 and plan.as_dict()["config"]["parallel"] is None
        assert make_plan(w, Target(budget * GiB, gpus=1)).as_dict() == plan.as_dict()
    assert main(["plan", str(BERT32), "--budget", "6GiB", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert main(["plan", str(BERT32), "--budget", "6GiB", "--gpus", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == without
    assert without["plan"]["config"]["gpus"] == 1


# ----------------------------------------------------------------------------------------- a rank's trace


def _as_rank(path: Path, world: int, applied: dict[str, Any] | None = None) -> Trace:
    trace = load_trace(path)
    trace.header["distributed"] = {"rank": 0, "world_size": world, "local_rank": 0, "backend": "gloo"}
    if applied is not None:
        trace.header["applied_config"] = applied
    return trace


def test_a_ddp_rank_trace_is_planned_from_its_one_process_equivalent() -> None:
    one = _recorded(TINY)[2]
    trace = _as_rank(TINY, 2)
    summary = build_summary(trace)
    w = workload(trace, summary)
    assert w is not None and w.measured_world_size == 2
    assert w.activations == 2 * one.activations and w.batch_size == 8
    assert w.parameters == one.parameters  # whole on every rank: DDP
    assert w.fwd_bwd_ms == pytest.approx(2 * one.fwd_bwd_ms)  # type: ignore[operator]
    assert any("rank 0 of a 2-rank job" in n for n in w.notes)
    back = predict(w, Config(gpus=2, parallel="ddp"))
    assert back.breakdown["activations"] == one.activations  # the rank's own share again
    planned = doctor(trace, summary, Target(8 * GiB, gpus=2))["plan"]
    assert planned["gpus"] == 2 and planned["config"]["parallel"] is not None


def test_an_fsdp_rank_trace_multiplies_its_sharded_state_back() -> None:
    one = _recorded(TINY)[2]
    trace = _as_rank(TINY, 2, {"parallel": "fsdp2"})
    w = workload(trace, build_summary(trace))
    assert w is not None and w.parameters == 2 * one.parameters
    assert w.optimizer_state == 2 * one.optimizer_state
    assert from_rank(one, load_trace(TINY), {}) is one  # a one-process trace as it is


def test_a_rank_trace_is_planned_for_its_job_by_default() -> None:
    trace = _as_rank(TINY, 2)
    target = ranks_target(trace, Target(GiB))
    assert target is not None and target.gpus == 2
    assert ranks_target(load_trace(TINY), Target(GiB)) == Target(GiB)


def test_a_measured_link_record_is_read() -> None:
    trace = load_trace(TINY)
    trace.collected.setdefault("device", {})["link"] = {
        "backend": "gloo",
        "bytes_per_s": 2e9,
        "measured": True,
        "world_size": 2,
    }
    w = workload(trace, build_summary(trace))
    assert w is not None and w.link_bytes_per_s == 2e9 and w.link_backend == "gloo"
    p = predict(w, Config(gpus=2, parallel="ddp"))
    assert p.time_parts["communication"] == pytest.approx(1e3 * w.gradients / 2e9)
    assert p.time_basis["communication"].startswith("measured: gloo collective bandwidth over 2 ranks")


# ----------------------------------------------------------------------------------------- the file


def test_the_plan_carries_gpus_parallel_and_shard_modules_into_memdoctor_yaml(
    bert: tuple[Trace, dict[str, Any], Workload],
) -> None:
    trace, summary, _ = bert
    out = doctor(trace, summary, Target(4 * GiB, gpus=2))
    plan = out["plan"]
    assert plan["fits"] and plan["config"]["gpus"] == 2 and plan["config"]["parallel"]
    config = config_for_summary(trace, {**summary, "plan": plan})
    assert config is not None and config.gpus == 2 and config.parallel == plan["config"]["parallel"]
    assert config.shard_modules == tuple(plan["config"]["shard_modules"])
    if config.parallel != "ddp":
        assert config.shard_modules[0] == "bert.encoder.layer.0" and len(config.shard_modules) == 12
    k = config.accumulation_steps
    assert config.micro_batch == 32 // 2 // k  # a rank's micro-batch: the batch split over the GPUs
    again = parse_config(dump_config(config))
    assert (again.gpus, again.parallel, again.shard_modules) == (2, config.parallel, config.shard_modules)


def test_memory_parts_stay_in_bytes(bert: tuple[Trace, dict[str, Any], Workload]) -> None:
    _, _, w = bert
    for engine in ("ddp", "fsdp2", "fsdp2-no-reshard"):
        p = predict(w, Config(gpus=2, parallel=engine, shard_modules=w.shard_names))
        assert all(isinstance(v, int) and v >= 0 for v in p.breakdown.values())
        assert p.reserved_bytes >= p.peak_bytes > 100 * MiB
