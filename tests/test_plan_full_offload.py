"""The planner's full offload (``full_offload: true``, FSDP2 with CPU offload): its memory and time model,
when the search considers it, and the plan it makes for a decoder whose fp32 parameters and gradients
alone exceed an 8 GiB budget. The lever itself is tested in test_full_offload.
"""

from __future__ import annotations

import dataclasses

import pytest

from memdoctor.config import config_for_summary, dump_config, from_plan, parse_config
from memdoctor.config.export import not_expressed, plain_loop_snippet
from memdoctor.plan.candidates import shard_units
from memdoctor.plan.config import Config, config_from_dict
from memdoctor.plan.memory import FULL_OFFLOAD_UNITS_HELD
from memdoctor.plan.model import predict, workload
from memdoctor.plan.planner import make_plan
from memdoctor.plan.target import Target
from memdoctor.plan.timing import CPU_OPTIMIZER_BYTES_PER_S
from memdoctor.plan.workload import Workload
from memdoctor.report import build_summary
from memdoctor.trace import load_trace
from tests.test_plan import _cand, hand_workload
from tests.tracebuilder import GiB

LLAMA_OOM = "tests/data/gpu-llama-1b-b4-s1024-8gib-oom.jsonl.gz"


def test_device_holds_the_root_unit_and_two_blocks_and_no_optimizer_state() -> None:
    w = hand_workload(shard_units=(20, 20, 20, 25), offload_bytes_per_s=1e3)  # root's own: 100 - 85
    p = predict(w, Config(full_offload=True))
    held = 15 + FULL_OFFLOAD_UNITS_HELD * 25
    assert p.breakdown["parameters"] == held
    assert p.breakdown["gradients"] == held
    assert p.breakdown["optimizer_state"] == 0
    assert p.breakdown["activations"] == 600  # as measured: offload leaves activations to the other levers
    assert any("full offload (FSDP2" in a for a in p.assumptions)


def test_time_is_the_host_link_and_the_host_optimizer_step() -> None:
    w = hand_workload(shard_units=(20, 20, 20, 25), offload_bytes_per_s=1e3)
    p = predict(w, Config(full_offload=True, accumulation_steps=2))
    moved = (2 * 85 + 15 + 100) * 2  # per micro-batch: units in twice, the root's once, gradients out
    assert p.time_parts["full_offload_transfers"] == pytest.approx(1e3 * moved / 1e3)
    assert p.time_parts["cpu_optimizer"] == pytest.approx(1e3 * (100 + 100 + 200) / CPU_OPTIMIZER_BYTES_PER_S)
    assert "measured pinned" in p.time_basis["full_offload_transfers"]
    assert p.time_basis["cpu_optimizer"].startswith("assumption")


def test_considered_only_when_the_state_alone_exceeds_the_budget() -> None:
    w = hand_workload(shard_units=(20, 20, 20, 25), offload_bytes_per_s=1e3)
    roomy = make_plan(w, Target(900))  # state 400 of a 810 limit: other levers do
    assert roomy.chosen is not None and not roomy.chosen.config.full_offload
    tight = make_plan(w, Target(380))  # state 400 > 342: nothing but full offload can fit
    assert tight.chosen is not None and tight.chosen.config.full_offload
    assert tight.chosen.config.optimizer == "as-is" and not tight.chosen.config.offload_parameters
    unknown = make_plan(dataclasses.replace(w, shard_units=()), Target(380))
    assert unknown.chosen is None  # no module table, no units: not modelled, as before


def _llama_1b1() -> Workload:
    """The recorded 0.95B decoder's trace (b4 s1024 on the H200) with its state grown to the 1.1B
    decoder's: 4.4 GB of parameters, 4.4 GB of gradients, 8.8 GB of AdamW state, 22 blocks."""
    trace = load_trace(LLAMA_OOM)
    summary = build_summary(trace)
    w = workload(trace, summary)
    assert w is not None
    big = dataclasses.replace(
        w,
        parameters=int(4.4e9),
        gradients=int(4.4e9),
        optimizer_state=int(8.8e9),
        shard_units=(int(176e6),) * 22,
        param_holders=[],
    )
    return big


def test_a_decoder_whose_parameters_and_gradients_exceed_8_gib_gets_a_plan() -> None:
    w = _llama_1b1()
    assert w.parameters + w.gradients > 8 * GiB
    without = make_plan(dataclasses.replace(w, shard_units=()), Target(8 * GiB))
    assert without.chosen is None  # what memdoctor said before: nothing fits
    plan = make_plan(w, Target(8 * GiB))
    assert plan.chosen is not None and plan.chosen.config.full_offload
    assert plan.chosen.reserved_bytes <= Target(8 * GiB).limit_bytes
    assert "full_offload_transfers" in plan.chosen.time_parts
    cfg = from_plan(plan.as_dict())
    assert cfg.full_offload and cfg.optimizer == "as-is"
    assert parse_config(dump_config(cfg)).full_offload


def test_the_recorded_decoders_units_are_its_blocks() -> None:
    trace = load_trace(LLAMA_OOM)
    summary = build_summary(trace)
    w = workload(trace, summary)
    assert w is not None and len(w.shard_units) == 16
    assert len(set(w.shard_units)) == 1  # 16 identical LlamaDecoderLayer blocks
    assert 0 < w.parameters - sum(w.shard_units) < w.parameters / 4  # embeddings, head, final norm
    assert config_for_summary(trace, summary) is not None


def test_config_vocabulary_round_trips() -> None:
    c = Config(full_offload=True, checkpoint=("a",))
    assert config_from_dict(c.as_dict()) == c
    assert config_from_dict({"checkpoint": ["a"]}).full_offload is False  # an older summary.json
    assert "offload" in c.families()
    assert any("FSDP2" in lever for lever in c.levers())


def test_checkpointing_under_full_offload_counts_every_held_gradient() -> None:
    w = hand_workload(shard_units=(20, 20, 20, 25), candidates=[_cand("block", 1, 300, 10.0)])
    p = predict(w, Config(full_offload=True, checkpoint=("block",)))
    assert p.breakdown["activations"] == 600  # 600 - 300 freed + 300 recomputed (the largest block)
    assert p.breakdown["gradients"] == 15 + FULL_OFFLOAD_UNITS_HELD * 25  # no mid-backward share


def test_exports_say_where_full_offload_applies() -> None:
    cfg = parse_config("memdoctor_config: 1\nfull_offload: true\n")
    assert any(n.startswith("full_offload: no single-process argument") for n in not_expressed(cfg, "hf"))
    assert not any(n.startswith("full_offload") for n in not_expressed(cfg, "plain"))
    assert "FSDP2" in plain_loop_snippet(cfg)


def test_not_planned_for_a_torch_without_fsdp2() -> None:
    trace = load_trace(LLAMA_OOM)
    assert len(shard_units(trace)) == 16
    trace.header["host"] = {**trace.header["host"], "torch": "2.3.1+cu121"}
    notes: list[str] = []
    assert shard_units(trace, notes) == ()
    assert notes and "has no FSDP2" in notes[0]
