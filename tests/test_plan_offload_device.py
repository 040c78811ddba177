"""The offload levers (optimizer state, parameters, full offload) move state from device memory to host
memory: on a CPU run planned for itself they are the same memory, so they save nothing and are never
proposed; planned for a CUDA card (the profiled one, or one named with ``--gpu``) they are."""

from __future__ import annotations

import dataclasses

from memdoctor.cards import find_card
from memdoctor.plan.alternatives import hand_tuning_baseline
from memdoctor.plan.config import Config
from memdoctor.plan.planner import make_plan
from memdoctor.plan.rules import RuleInput, parameter_offload
from memdoctor.plan.target import Target
from memdoctor.plan.tiers import tier_one, tier_two
from memdoctor.plan.workload import ParamHolder, Workload
from tests.test_plan import hand_workload
from tests.tracebuilder import TraceBuilder, tiny_mlp

HOLDER = ParamHolder(name="emb", param_bytes=80, grad_bytes=80, forward_ms=0.1)


def _offloads(configs: list[Config]) -> set[str]:
    found: set[str] = set()
    for c in configs:
        found |= {"optimizer offload"} if c.optimizer == "offload" else set()
        found |= {"parameter offload"} if c.offload_parameters else set()
        found |= {"full offload"} if c.full_offload else set()
    return found


def _workload(kind: str | None) -> Workload:
    """400 bytes of state against a 380 budget: only moving state to the host can fit it."""
    return hand_workload(device_kind=kind, param_holders=[HOLDER], shard_units=(20, 20, 20, 25))


def test_no_offload_lever_on_a_cpu_run_planned_for_itself() -> None:
    target = Target(380)
    cpu = _workload("cpu")
    assert _offloads(tier_one(cpu, target) + tier_two(cpu, target)) == set()
    plan = make_plan(cpu, target)
    assert plan.chosen is None  # nothing fits: moving state to the host frees nothing here
    best = plan.closest
    assert best is not None and not _offloads([best.config])
    assert any("offloading to host memory frees none" in a for a in plan.advice), plan.advice


def test_every_offload_lever_on_a_cuda_run_or_for_a_named_card() -> None:
    target = Target(380)
    for w, t in (
        (_workload("cuda"), target),
        (_workload(None), target),
        (_workload("cpu"), Target(380, card=find_card("RTX 2070"))),
    ):
        found = _offloads(tier_one(w, t) + tier_two(w, t))
        assert found == {"optimizer offload", "parameter offload", "full offload"}, (w.device_kind, t.card)
    plan = make_plan(_workload("cuda"), target)
    assert plan.chosen is not None and _offloads([plan.chosen.config])  # where the CPU run's had none


def test_the_parameter_offload_finding_and_the_hand_tuning_baseline_leave_a_cpu_run_alone() -> None:
    b = TraceBuilder(kind="cpu", budget_bytes=None)
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=1)
    trace = b.end("completed").build()
    target = Target(700)
    low = dataclasses.replace(_workload("cuda"), compute_class="low")  # the baseline offloads first
    assert parameter_offload(RuleInput(trace, {}, low, target))
    assert not parameter_offload(RuleInput(trace, {}, dataclasses.replace(low, device_kind="cpu"), target))
    baseline = hand_tuning_baseline(trace, low, target)
    assert baseline is not None and baseline.config.optimizer == "offload"
    baseline = hand_tuning_baseline(trace, dataclasses.replace(low, device_kind="cpu"), target)
    assert baseline is None or not _offloads([baseline.config])
