"""The analysis layer on hand-built traces: summary.json's figures, peak selection, top layers, faults."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
from tracebuilder import GiB, MiB, TraceBuilder, bert_like, completed_trace, oom_trace, tiny_mlp

from memdoctor.analysis import layer_table, peak_step, timeline_series, top_layers
from memdoctor.analysis.faults import live_at_fault, module_stack
from memdoctor.analysis.headline import headline
from memdoctor.analysis.layers import subtree_sums
from memdoctor.report import build_summary
from memdoctor.trace import Trace
from memdoctor.units import format_bytes


@pytest.fixture(scope="module")
def bert() -> Trace:
    return completed_trace(layers=2)


@pytest.fixture(scope="module")
def summary(bert: Trace) -> dict:
    return build_summary(bert)


def test_summary_top_level_keys(summary: dict) -> None:
    for key in (
        "format_version",
        "memdoctor_version",
        "status",
        "device",
        "steps_profiled",
        "peak_memory_bytes",
        "peak_source",
        "categories",
        "accounted_fraction",
        "step_time_ms",
        "phases_ms",
        "layers",
        "fault",
    ):
        assert key in summary
    assert summary["format_version"] == 1
    assert summary["status"] == "completed"
    assert summary["fault"] is None
    original = ("name", "kind", "total_memory_bytes", "memory_cap_bytes")  # later keys only extend it
    assert {k: summary["device"][k] for k in original} == {
        "name": "NVIDIA GeForce RTX 2070",
        "kind": "cuda",
        "total_memory_bytes": 8 * GiB,
        "memory_cap_bytes": None,
    }
    json.dumps(summary, allow_nan=False)  # strict JSON


def test_peak_is_the_largest_profiled_step(bert: Trace, summary: dict) -> None:
    profiled = bert.profiled_steps()
    best = max(profiled, key=lambda s: s.memory["peak_bytes"])
    assert summary["steps_profiled"] == 3
    assert summary["peak_step"] == best.step and not best.warmup
    assert summary["peak_memory_bytes"] == best.memory["peak_bytes"]
    assert summary["peak_source"] == "allocator"
    assert summary["peak_from_incomplete_step"] is False
    assert summary["categories"] == best.memory["categories_at_peak"]
    assert summary["accounted_fraction"] == pytest.approx(
        best.memory["accounted_bytes"] / best.memory["peak_bytes"], abs=1e-4
    )


def test_step_time_and_phases_are_medians(bert: Trace, summary: dict) -> None:
    profiled = bert.profiled_steps()
    assert summary["step_time_ms"] == pytest.approx(statistics.median(s.duration_ms for s in profiled))
    for phase in ("forward", "backward", "optimizer"):
        assert summary["phases_ms"][phase] == pytest.approx(
            statistics.median(s.phases_ms[phase] for s in profiled)
        )


def test_layers_cover_every_module_with_trace_figures(bert: Trace, summary: dict) -> None:
    info, step = bert.models[0], peak_step(bert)
    cols = step.modules[0]
    layers = summary["layers"]
    assert len(layers) == len(info.names)
    assert layers[0]["name"] == "(BertForSequenceClassification)"
    assert [row["name"] for row in layers[1:]] == info.names[1:]  # one model: no prefix
    assert [row["param_bytes"] for row in layers] == info.param_bytes
    assert [row["activation_bytes"] for row in layers] == cols["activation_bytes"]
    assert [row["grad_bytes"] for row in layers] == cols["grad_bytes"]
    assert [row["backward_ms"] for row in layers] == cols["backward_ms"]
    assert set(layers[0]) >= {
        "name",
        "type",
        "param_bytes",
        "grad_bytes",
        "optimizer_state_bytes",
        "activation_bytes",
        "checkpoint_free_bytes",
        "forward_ms",
        "backward_ms",
    }


def test_layer_table_inclusive_sums(bert: Trace) -> None:
    rows = layer_table(bert, peak_step(bert))
    info = bert.models[0]
    assert rows[0]["inclusive"]["parameters"] == sum(info.param_bytes)
    assert subtree_sums(info, info.param_bytes)[0] == sum(info.param_bytes)
    assert [r["depth"] for r in rows[:3]] == [0, 1, 2]


def test_summary_is_the_same_after_save_and_load(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.add_model(bert_like(layers=1))
    b.add_steps(warmup=1, profiled=2)
    b.end("completed")
    assert build_summary(b.roundtrip(tmp_path)) == build_summary(b.build())


def test_headline_names_peak_budget_and_biggest_category(summary: dict) -> None:
    share = round(100 * summary["categories"]["activations"] / summary["peak_memory_bytes"])
    assert summary["headline"] == headline(summary)
    assert summary["headline"].endswith(f"of 8.00 GiB budget: {share}% of it activations.")


def test_headline_says_by_how_much_the_budget_is_exceeded() -> None:
    s = build_summary(completed_trace(layers=2, budget_bytes=256 * MiB))
    assert "over" in s["headline"] and "256.00 MiB budget" in s["headline"]


# ----------------------------------------------------------------------------------------- faults


def test_oom_fault_names_step_phase_and_module() -> None:
    trace = oom_trace(layers=2)
    s = build_summary(trace)
    assert s["status"] == "oom"
    assert s["steps_profiled"] == 0
    assert s["peak_from_incomplete_step"] is True
    assert s["peak_memory_bytes"] == trace.steps[0].memory["peak_bytes"]
    fault = s["fault"]
    assert fault["kind"] == "oom" and fault["step"] == 0 and fault["phase"] == "backward"
    assert fault["module_name"] == "bert.encoder.layer.1"
    assert fault["exception_type"] == "torch.OutOfMemoryError"
    assert fault["message"].startswith("CUDA out of memory. Tried to allocate")
    assert s["headline"].startswith(
        "The script died of CUDA out of memory at step 0, in the backward of bert.encoder.layer.1"
    )


def test_live_at_fault_is_the_last_sample_of_the_dying_step() -> None:
    trace = oom_trace(layers=2)
    live = live_at_fault(trace)
    tl = trace.steps[-1].timeline
    assert live is not None
    assert live["t_ms"] == tl["t_ms"][-1]
    assert live["categories"] == {
        c: tl[c][-1] for c in ("parameters", "gradients", "optimizer_state", "activations")
    }
    assert live["allocator"]["allocated"] == tl["allocated"][-1]
    assert live["module_stack"] == [
        "(BertForSequenceClassification)",
        "bert",
        "bert.encoder",
        "bert.encoder.layer",
        "bert.encoder.layer.1",
    ]


def test_fault_without_events_comes_from_the_end_record() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=2)
    s = build_summary(b.end("killed", "killed by SIGKILL", signal="SIGKILL", exit_code=None).build())
    assert s["fault"]["kind"] == "killed"
    assert s["fault"]["message"] == "killed by SIGKILL"
    assert s["headline"] == "The script was killed by SIGKILL after 2 complete steps."
    assert s["live_at_fault"] is None  # every step completed


@pytest.mark.parametrize(
    ("status", "exit_code", "is_fault"),
    [
        ("completed", 0, False),
        ("script_finished", 0, False),
        ("no_steps", 0, False),
        ("script_exit", 0, False),
        ("script_exit", 3, True),
        ("exception", 1, True),
        ("interrupted", 130, True),
    ],
)
def test_which_statuses_are_faults(status: str, exit_code: int, is_fault: bool) -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=1)
    s = build_summary(b.end(status, exit_code=exit_code).build())
    assert (s["fault"] is not None) == is_fault


@pytest.mark.parametrize(
    ("status", "start"),
    [
        ("script_exit", "The script called sys.exit(3) at step 0, in the backward of 2"),
        ("interrupted", "The run was interrupted (Ctrl-C) at step 0, in the backward of 2"),
        ("exception", "The script died of an exception at step 0, in the backward of 2"),
    ],
)
def test_fault_headlines(status: str, start: str) -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    b.add_step(die_at=("backward", "2"))
    s = build_summary(b.end(status, exit_code=3).build())
    assert s["headline"].startswith(start + ", with ")


def test_no_end_record_is_unknown_and_not_a_fault() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=1)
    s = build_summary(b.build())
    assert s["status"] == "unknown" and s["fault"] is None


def test_no_steps_at_all() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    s = build_summary(b.end("no_steps", "the script ended without an optimizer step").build())
    assert s["peak_memory_bytes"] is None and s["steps_profiled"] == 0
    assert s["step_time_ms"] is None and s["phases_ms"] == {}
    assert s["headline"].startswith("No training step was recorded")
    assert all(row["activation_bytes"] is None for row in s["layers"])


def test_no_steps_says_why_when_the_run_knows() -> None:
    """Training in a spawned process (mnist_hogwild's shape): the headline carries the run's reason."""
    from memdoctor.exitcodes import NO_STEPS
    from memdoctor.launch.supervisor import _ended

    last = {"exit_code": 0, "processes_started": 2}
    status, code, message = _ended("script_finished", last, 0)
    assert (status, code) == ("no_steps", NO_STEPS)
    assert "started 2 processes" in message and "not profiled" in message
    assert "process" not in _ended("script_finished", {"exit_code": 0}, 0)[2]
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    s = build_summary(b.end("no_steps", message).build())
    assert s["status_message"] == message
    assert "started 2 processes" in s["headline"] and s["headline"].startswith("No training step")


def test_incomplete_step_without_recorded_categories_uses_the_timeline() -> None:
    trace = oom_trace(layers=1)
    step = trace.steps[0]
    for key in ("peak_bytes", "categories_at_peak"):
        del step.memory[key]
    s = build_summary(trace)
    totals = step.timeline["max_allocated"]
    assert s["peak_memory_bytes"] == max(totals)
    assert s["categories"]["other"] is None
    assert s["categories"]["parameters"] == step.timeline["parameters"][0]


# ----------------------------------------------------------------------------------------- devices and models


def test_cpu_trace_has_no_allocator_figures() -> None:
    s = build_summary(completed_trace(kind="cpu", budget_bytes=None, layers=1))
    share = round(100 * s["categories"]["activations"] / s["peak_memory_bytes"])
    assert s["peak_source"] == "accounting"
    assert s["categories"]["other"] is None
    assert s["accounted_fraction"] == 1.0
    assert any("allocator" in note for note in s["not_measured"])
    peak = format_bytes(s["peak_memory_bytes"])
    assert s["headline"] == f"Measured peak {peak} in tensors: {share}% of it activations."


def test_allocator_note_is_derived_when_the_header_does_not_say() -> None:
    b = TraceBuilder(kind="cpu", not_measured=[])
    b.add_model(tiny_mlp())
    b.add_steps(warmup=0, profiled=1)
    assert build_summary(b.build())["not_measured"] == ["allocator figures: not recorded in this trace"]


def test_downsampled_timeline_is_noted() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp())
    b.add_step(stride=4)
    assert any("downsampled" in note for note in build_summary(b.build())["not_measured"])


def test_several_models_get_prefixed_names() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp(depth=1), cls="Generator")
    b.add_model(tiny_mlp(depth=2), cls="Discriminator")
    b.add_steps(warmup=0, profiled=1)
    s = build_summary(b.end().build())
    names = [row["name"] for row in s["layers"]]
    assert names == [
        "model0:(Generator)",
        "model0:0",
        "model0:1",
        "model1:(Discriminator)",
        "model1:0",
        "model1:1",
        "model1:2",
        "model1:3",
    ]
    assert [row["model"] for row in s["layers"]] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_module_stack_of_unknown_module_is_empty(bert: Trace) -> None:
    assert module_stack(bert, 0, None) == []
    assert module_stack(bert, 7, 1) == []


# ----------------------------------------------------------------------------------------- plots' data


def test_top_layers_of_a_bert_are_its_blocks(bert: Trace) -> None:
    names = [b["name"] for b in top_layers(bert, peak_step(bert))]
    assert names == [
        "bert.embeddings",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "bert.pooler",
        "dropout",
        "classifier",
    ]


def test_top_layers_sum_inclusive_figures(bert: Trace) -> None:
    bars = top_layers(bert, peak_step(bert))
    total_params = sum(bert.models[0].param_bytes)
    assert sum(b["parameters"] for b in bars) == total_params
    assert all(
        b["total"] == sum(b[c] for c in ("parameters", "gradients", "optimizer_state", "activations"))
        for b in bars
    )


def test_top_layers_groups_the_rest() -> None:
    trace = completed_trace(layers=12)
    full = top_layers(trace, peak_step(trace))
    bars = top_layers(trace, peak_step(trace), limit=5)
    assert len(bars) == 5
    assert bars[-1]["name"] == f"other ({len(full) - 4} layers)"
    assert sum(b["total"] for b in bars) == sum(b["total"] for b in full)


def test_top_layers_of_a_sequential_are_its_children() -> None:
    b = TraceBuilder()
    b.add_model(tiny_mlp(depth=2))
    b.add_steps(warmup=0, profiled=1)
    trace = b.build()
    assert [x["name"] for x in top_layers(trace, peak_step(trace))] == ["0", "1", "2", "3"]


def test_top_layers_show_what_a_wrapper_owns() -> None:
    mods = [
        ("", "Net", 40 * MiB, 0),
        ("body", "Body", 0, 0),
        ("body.a", "Linear", 80 * MiB, MiB),
        ("body.b", "Linear", 80 * MiB, MiB),
    ]
    b = TraceBuilder()
    b.add_model(mods)
    b.add_steps(warmup=0, profiled=1)
    trace = b.build()
    bars = top_layers(trace, peak_step(trace))
    assert [x["name"] for x in bars] == ["(Net) (own)", "body.a", "body.b"]
    assert bars[0]["parameters"] == 40 * MiB


def test_timeline_series_is_plot_ready(bert: Trace) -> None:
    step = peak_step(bert)
    series = timeline_series(step)
    n = len(series["t_ms"])
    assert all(len(v) == n for v in series["categories"].values())
    assert set(series["allocator"]) == {"allocated", "reserved"}
    assert [p["phase"] for p in series["phases"]] == ["forward", "backward", "optimizer"]
    spans = series["phases"]
    assert all(a["end_ms"] == b["start_ms"] for a, b in itertools.pairwise(spans))
    assert series["peak_bytes"] == step.memory["peak_bytes"]


def test_phase_spans_colour_the_interval_that_ends_at_each_sample() -> None:
    from memdoctor.analysis.steps import phase_spans

    # the step opens after the last step's optimizer step: 200 ms of data loading ("other"), then
    # the forward and the backward
    t = [0.0, 200.0, 210.0, 250.0, 300.0]
    phases = ["optimizer", "other", "forward", "forward", "backward"]
    assert phase_spans(t, phases) == [
        {"phase": "other", "start_ms": 0.0, "end_ms": 200.0},
        {"phase": "forward", "start_ms": 200.0, "end_ms": 250.0},
        {"phase": "backward", "start_ms": 250.0, "end_ms": 300.0},
    ]
