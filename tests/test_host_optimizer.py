"""The host's optimizer rate: measured by the device-facts collector only where full offload is plausible
(a CUDA run whose model state exceeds the budget), recorded in the ``device`` record, carried into
``summary.json`` and the ``Workload``, and used by the time model instead of the assumed rate."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.capture import devicefacts
from memdoctor.capture.devicefacts import DeviceFactsCollector
from memdoctor.capture.hostoptimizer import measure_host_optimizer, state_estimate, worth_measuring
from memdoctor.device import Device
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.model import predict
from memdoctor.plan.timing import CPU_OPTIMIZER_BYTES_PER_S
from memdoctor.report import build_summary
from tests.test_plan import hand_workload
from tests.tracebuilder import GiB, TraceBuilder, tiny_mlp


def test_the_measurement_steps_adamw_on_the_cpu() -> None:
    found = measure_host_optimizer(2**20)
    assert found["bytes"] == 2**20 and found["repeats"] >= 1
    assert found["bytes_per_s"] > 0 and found["threads"] == torch.get_num_threads()


def test_the_state_estimate_counts_the_device_parameters_their_gradients_and_adams_moments() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[1].requires_grad_(False)
    p = sum(x.numel() * 4 for x in model.parameters())
    frozen = sum(x.numel() * 4 for x in model[1].parameters())
    assert state_estimate([model], []) == 0  # on CUDA only: these are on the CPU
    cpu = functools.partial(state_estimate, device_type="cpu")
    assert cpu([model], ["AdamW"]) == p + 3 * (p - frozen)
    assert cpu([model], []) == p + 3 * (p - frozen)  # no optimizer seen: Adam, the planner's assumption
    assert cpu([model], ["SGD"]) == p + (p - frozen)
    assert cpu([model, model], ["SGD"]) == p + (p - frozen)  # a parameter counts once


def test_the_capture_and_the_planner_agree_on_adams_family() -> None:
    from memdoctor.capture import hostoptimizer
    from memdoctor.plan import reprofiled

    assert hostoptimizer.TWO_MOMENT_OPTIMIZERS == reprofiled.TWO_MOMENT_OPTIMIZERS


def test_only_where_full_offload_is_plausible() -> None:
    assert worth_measuring("cuda", 10 * GiB, 8 * GiB)
    assert not worth_measuring("cuda", 4 * GiB, 8 * GiB)  # the state fits: it cannot matter
    assert not worth_measuring("cpu", 10 * GiB, 8 * GiB)  # host and device memory are one
    assert not worth_measuring("cuda", 10 * GiB, None)


def _collector(state: int, monkeypatch: pytest.MonkeyPatch) -> tuple[DeviceFactsCollector, list[Any]]:
    """A collector past its start on a (pretend) 8 GiB CUDA device whose models hold ``state``."""
    monkeypatch.setattr(devicefacts, "state_estimate", lambda roots, optimizers, device_type: state)
    monkeypatch.setattr(devicefacts, "measure_host_optimizer", lambda: {"bytes_per_s": 5e9, "threads": 4})
    emitted: list[Any] = []
    model = SimpleNamespace(modules=[nn.Linear(2, 2)], info=SimpleNamespace(optimizers=[{"class": "AdamW"}]))
    session = SimpleNamespace(models=[model], emit=lambda name, data: emitted.append((name, dict(data))))
    c = DeviceFactsCollector(Device())
    c.session, c.facts = session, {"kind": "cuda", "total_memory_bytes": 8 * GiB, "host_optimizer": None}
    return c, emitted


def test_the_collector_measures_once_at_discovery_where_the_state_exceeds_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, emitted = _collector(9 * GiB, monkeypatch)
    c.on_model(0, None)
    c.on_model(1, None)  # a second model: measured once
    assert len(emitted) == 1 and emitted[0][0] == "device"
    assert emitted[0][1]["host_optimizer"] == {"bytes_per_s": 5e9, "threads": 4}
    c, emitted = _collector(6 * GiB, monkeypatch)
    c.on_model(0, None)
    assert emitted == [] and c.facts is not None and c.facts["host_optimizer"] is None


def test_a_cpu_session_never_measures_it() -> None:
    records: list[dict[str, Any]] = []
    from memdoctor.capture.session import ProfileSession

    collector = DeviceFactsCollector()
    session = ProfileSession(steps=1, warmup=0, sink=records.append, collectors=[collector])
    session.start()
    collector.on_model(0, nn.Linear(2, 2))
    session.stop()
    device = [r["data"] for r in records if r["type"] == "collector" and r["name"] == "device"]
    assert len(device) == 1 and device[0]["host_optimizer"] is None


def test_the_time_model_uses_the_measured_rate_and_says_so() -> None:
    w = hand_workload(shard_units=(20, 20, 20, 25), offload_bytes_per_s=1e3)
    p = predict(w, Config(full_offload=True))
    assert p.time_parts["cpu_optimizer"] == pytest.approx(1e3 * 400 / CPU_OPTIMIZER_BYTES_PER_S)
    assert "assumption: the H200 host's measured rate" in p.time_basis["cpu_optimizer"]
    measured = dataclasses.replace(w, host_optimizer_bytes_per_s=2e3, host_threads=6)
    p = predict(measured, Config(full_offload=True))
    assert p.time_parts["cpu_optimizer"] == pytest.approx(1e3 * 400 / 2e3)
    assert p.time_basis["cpu_optimizer"].startswith("measured: a foreach AdamW step on this host's 6 CPU")


def test_the_recorded_rate_reaches_the_workload() -> None:
    b = TraceBuilder(kind="cuda", budget_bytes=8 * GiB)
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=2)
    trace = b.end("completed").build()
    rate = {"bytes_per_s": 9.5e9, "bytes": 2**27, "repeats": 3, "threads": 16, "optimizer": "AdamW"}
    trace.collected["device"] = {"kind": "cuda", "host_optimizer": rate}
    summary = build_summary(trace)
    keys = ("bytes_per_s", "bytes", "repeats", "threads")
    assert summary["device"]["host_optimizer"] == {k: rate[k] for k in keys}
    w = measured_workload(trace, summary)
    assert w is not None and w.host_optimizer_bytes_per_s == 9.5e9 and w.host_threads == 16
    trace.collected["device"] = {"kind": "cuda", "host_optimizer": {"bytes_per_s": -1}}  # hostile: ignored
    w = measured_workload(trace, build_summary(trace))
    assert w is not None and w.host_optimizer_bytes_per_s is None


def test_the_measurement_is_not_taken_for_a_step_of_the_script() -> None:
    """torch's optimizer-step hooks are global: on the H200 the measurement, run at the fault of a 1.1B
    decoder that died in its first forward, closed a "complete" step 0 and the plan took the model as
    fully measured. memdoctor's own optimizer is passed over by the session's step hooks."""
    from memdoctor.capture.session import ProfileSession

    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=0, sink=records.append)
    session.start()
    measure_host_optimizer(2**20)
    session.stop()
    assert [r for r in records if r["type"] == "step"] == []
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records.clear()
    session = ProfileSession(steps=2, warmup=0, sink=records.append)
    session.start()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # the script's own step still counts
    session.stop()
    assert len([r for r in records if r["type"] == "step"]) == 1
