"""One story of numbers: every peak the report quotes carries its memory (allocated, reserved) and its
kind (measured, extrapolated, predicted); savings never exceed what they save from; the footer claims
no more than the page shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tracebuilder import GiB, TraceBuilder, bert_like, completed_trace

from memdoctor.analysis.layers import top_layers
from memdoctor.analysis.steps import peak_step
from memdoctor.plan.model import workload
from memdoctor.plan.planner import card_table
from memdoctor.report import build_summary, plots, plots_plan
from memdoctor.report.peaks import footer_note, peak_parts, peak_rows
from memdoctor.report.render import activations_live, layer_chart
from memdoctor.trace import Trace, load_trace

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def reprofiled() -> tuple[Trace, dict[str, Any]]:
    """The recorded BERT-base b32 s512 run that died under 8 GiB and was planned from a re-profile."""
    trace = load_trace(DATA / "gpu-bert-base-b32-s512-8gib-reprofiled.jsonl.gz")
    return trace, build_summary(trace)


def test_every_peak_of_a_reprofiled_run_says_what_it_is(reprofiled: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = reprofiled
    rows = peak_rows(trace, summary)
    kinds = [(r["memory"], r["kind"]) for r in rows]
    assert kinds == [
        ("allocated", "measured"),  # the run until it died
        ("allocated", "extrapolated"),  # the re-profile scaled to the full batch
        ("reserved", "predicted"),  # the script as it is on a card
        ("reserved", "predicted"),  # the plan
        ("reserved", "measured"),  # the plan, verified
    ]
    w = workload(trace, summary)
    assert w is not None
    assert rows[0]["bytes"] == summary["peak_memory_bytes"] and "lower bound" in rows[0]["what"]
    assert rows[1]["bytes"] == w.peak_bytes and "re-profile" in rows[1]["what"]
    assert rows[3]["bytes"] == summary["plan"]["predicted_reserved_bytes"]
    planned = summary["plan"]["planned_peak"]
    assert planned.endswith("extrapolated to the full batch from the re-profile at micro-batch 1/2")
    as_is = [c for c in card_table(w) if c["verdict"] == "fits as-is"]
    assert as_is and all(c["predicted_reserved_bytes"] == rows[2]["bytes"] for c in as_is)


def test_no_saving_exceeds_what_it_saves_from(reprofiled: tuple[Trace, dict[str, Any]]) -> None:
    """The recorded re-profile's blocks add up to more than its activations (each block measured over
    both micro-batches, then scaled): the checkpointing finding still frees no more than them."""
    trace, summary = reprofiled
    w = workload(trace, summary)
    assert w is not None
    (ckpt,) = [f for f in summary["findings"] if f["rule"] == "checkpointing"]
    assert 0 < ckpt["saving_bytes"] <= w.activations < w.peak_bytes
    assert "allocated peak, extrapolated" in ckpt["evidence"]
    for f in summary["findings"]:
        assert f["saving_bytes"] <= w.peak_bytes, f["rule"]
    (pad,) = [f for f in summary["findings"] if f["rule"] == "dynamic_padding"]
    assert pad["plan_note"].startswith("not in the plan") and "longest batch" in pad["plan_note"]


def test_footer_claims_no_more_than_the_page_shows(reprofiled: tuple[Trace, dict[str, Any]]) -> None:
    trace, summary = reprofiled
    note = footer_note(peak_rows(trace, summary), summary["findings"])
    assert "none is predicted" not in note
    assert "extrapolated" in note and "predicted" in note and "measured with it applied" in note
    measured = [{"bytes": 1, "memory": "allocated", "kind": "measured", "what": "the run"}]
    assert footer_note(measured, []) == "Every figure is measured in that run; none is predicted."
    assert "predicted" in footer_note(measured, [{"saving_bytes": 10}]).replace("none is predicted", "")


def test_a_planned_run_has_no_extrapolated_peak_and_says_it_predicts() -> None:
    trace = completed_trace(kind="cuda", budget_bytes=8 * GiB, layers=2)
    summary = build_summary(trace)
    rows = peak_rows(trace, summary)
    assert [r["kind"] for r in rows][:2] == ["measured", "predicted"]
    assert "extrapolated" not in {r["kind"] for r in rows}
    assert "none is predicted" not in footer_note(rows, summary["findings"])


def test_a_run_without_a_plan_or_savings_predicts_nothing() -> None:
    trace = completed_trace(kind="cpu", budget_bytes=None, layers=1)
    summary = build_summary(trace)
    assert summary["plan"] is None
    rows = peak_rows(trace, summary)
    assert [(r["memory"], r["kind"]) for r in rows] == [("in tensors", "measured")]
    assert not any(f["saving_bytes"] for f in summary["findings"])
    assert footer_note(rows, summary["findings"]).endswith("none is predicted.")


def _died_in_forward() -> Trace:
    b = TraceBuilder(kind="cuda", budget_bytes=4 * GiB)
    b.add_model(bert_like(layers=4))
    b.add_step(warmup=True, die_at=("forward", "bert.encoder.layer.1"))
    trace = b.end("oom", "CUDA out of memory during step 0", exit_code=1).build()
    for cols in trace.steps[0].modules.values():  # as capture counts them: a module the run never reached
        cols["calls"] = [1 if ms else 0 for ms in cols["forward_ms"]]  # finished no call
    return trace


def test_layers_a_run_never_reached_are_not_drawn_as_measured() -> None:
    """The bars of layers after the one the run died in say they never ran (``ran`` False), so the
    chart marks them "not reached" instead of drawing them as cheap."""
    trace = _died_in_forward()
    bars = {b["name"]: b for b in top_layers(trace, peak_step(trace))}
    assert bars["bert.embeddings"]["ran"] and bars["bert.embeddings"]["activations"] > 0
    for name in ("bert.encoder.layer.1", "bert.encoder.layer.2", "bert.encoder.layer.3", "classifier"):
        assert not bars[name]["ran"] and bars[name]["activations"] == 0
    summary = build_summary(trace)
    assert layer_chart(trace, summary) is not None
    assert layer_chart(trace, summary) != plots.layer_bars(list(bars.values()))  # the marks are drawn


def test_bars_of_a_peak_in_the_optimizer_step_hold_no_activations() -> None:
    """The recorded BERT b8 run peaks in its optimizer step, when its activations are freed: the
    chart's activations are then drawn as not part of the peak."""
    trace = load_trace(DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz")
    summary = build_summary(trace)
    assert summary["peak_phase"] == "optimizer" and not activations_live(summary)
    bars = top_layers(trace, peak_step(trace))
    assert sum(b["activations"] for b in bars) > 100 * summary["categories"]["activations"]
    assert plots.layer_bars(bars, False) != plots.layer_bars(bars, True)
    assert activations_live(build_summary(completed_trace(layers=2)))


def test_the_reprofile_a_plan_comes_from_is_plotted(reprofiled: tuple[Trace, dict[str, Any]]) -> None:
    """Planned from a re-profile: the chart holds the run that died, the re-profile as measured, its
    full-batch extrapolation, the plan and the plan verified, each bar adding up to its peak."""
    trace, summary = reprofiled
    bars = peak_parts(trace, summary)
    assert [b["kind"] for b in bars] == ["measured", "measured", "extrapolated", "predicted", "measured"]
    w = workload(trace, summary)
    assert w is not None
    k = summary["reprofile"]["accumulation_steps"]
    assert bars[0]["total"] == summary["peak_memory_bytes"] and bars[2]["total"] == w.peak_bytes
    assert bars[1]["parts"]["activations"] * k == pytest.approx(w.activations, abs=k)
    assert bars[1]["total"] < bars[2]["total"]
    assert bars[1]["total"] <= summary["plan"]["budget_bytes"]  # it ran under the same 8 GiB cap
    assert bars[3]["total"] == summary["plan"]["predicted_peak_bytes"]
    for b in bars:
        assert sum(b["parts"].values()) == b["total"], b["label"]
    assert plots_plan.peak_parts(bars, summary["plan"]["budget_bytes"]) is not None


def test_a_run_measured_whole_plots_no_reprofile() -> None:
    trace = completed_trace(kind="cuda", budget_bytes=8 * GiB, layers=2)
    assert peak_parts(trace, build_summary(trace)) == []
    assert plots_plan.peak_parts([], None) is None
