"""Reports rendered on a CPU from traces recorded on an NVIDIA H200 (commands in BENCHMARKS.md).

These are the BERT-base workloads: BERT-base sequence classification (batch 32, padded to 512, fp32,
AdamW) with and without an 8 GiB cap, a configuration that fits the cap, and GPT-2 small with the
Hugging Face Trainer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memdoctor.report import build_summary, render_report, write_report
from memdoctor.trace import load_trace

DATA = Path(__file__).parent / "data"
GiB = 2**30
LEDGER = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def load(name: str):
    return load_trace(DATA / f"{name}.jsonl.gz")


@pytest.mark.parametrize("path", sorted(DATA.glob("gpu-*.jsonl.gz")), ids=lambda p: p.name)
def test_recorded_trace_renders_on_cpu(path: Path, tmp_path: Path) -> None:
    trace = load_trace(path)
    assert trace.device["kind"] == "cuda" and trace.device["name"] == "NVIDIA H200"
    paths = write_report(trace, tmp_path)
    assert paths["report"].stat().st_size < 3 * 2**20
    assert path.stat().st_size < 2 * 2**20  # a 12-layer model's trace stays well under 2 MB


def test_story_oom_under_8gib_keeps_what_was_live_when_it_died() -> None:
    trace = load("gpu-bert-base-b32-s512-8gib-oom")
    summary = build_summary(trace)
    assert trace.device["memory_cap_bytes"] == 8 * GiB
    assert trace.end is not None and trace.end["status"] == "oom" and trace.end["memdoctor_exit_code"] == 6
    assert summary["steps_profiled"] == 0 and summary["peak_from_incomplete_step"]
    fault = summary["fault"]
    assert fault["kind"] == "oom" and fault["step"] == 0 and fault["phase"] == "forward"
    assert fault["module_name"].startswith("bert.encoder.layer.")
    live = summary["live_at_fault"]["categories"]
    assert live["activations"] > 6 * GiB  # what held the card when it died: saved activations
    assert 0.4 * GiB < live["parameters"] < 0.45 * GiB  # BERT-base, fp32
    assert summary["peak_memory_bytes"] <= 8 * GiB
    names = {layer["name"] for layer in summary["layers"]}
    assert "bert.encoder.layer.11.attention.self" in names


@pytest.mark.parametrize(
    "name",
    ["gpu-bert-base-b32-s512-fp32", "gpu-gpt2-small-trainer-b8-s512", "gpu-bert-base-b32-s512-8gib-oom"],
)
def test_peak_ledger_accounts_for_the_allocator_peak(name: str) -> None:
    """The ledger's categories sum to within 5% of max_memory_allocated at the peak."""
    summary = build_summary(load(name))
    led = summary["peak_ledger"]
    cats = led["categories"]
    assert abs(sum(cats.values()) - led["peak_allocated"]) <= 4096  # exact sizes vs 512-byte blocks
    step = next(s for s in load(name).steps if s.step == led["step"])
    allocator_peak = step.memory["allocator"]["max_allocated"]
    assert abs(led["peak_allocated"] - allocator_peak) <= 0.05 * allocator_peak
    attributed = sum(cats[c] for c in LEDGER)
    assert attributed >= 0.95 * allocator_peak, cats


def test_gpt2_trainer_temporaries_are_the_loss_backward() -> None:
    trace = load("gpu-gpt2-small-trainer-b8-s512")
    summary = build_summary(trace)
    assert trace.models[0].cls == "GPT2LMHeadModel"
    assert "transformer.h.11.attn" in trace.models[0].names
    led = summary["peak_ledger"]
    logits = 8 * 512 * 50257 * 4  # batch x sequence x vocabulary, fp32
    assert led["categories"]["temporaries"] >= 1.9 * logits  # two logits-sized gradients at the peak
    assert summary["peak_phase"] == "backward"


def test_fitting_config_peaks_in_adamw_step() -> None:
    summary = build_summary(load("gpu-bert-base-b8-s128-8gib"))
    assert summary["status"] == "completed" and summary["steps_profiled"] == 5
    assert summary["peak_memory_bytes"] < 8 * GiB
    assert summary["peak_phase"] == "optimizer"
    led = summary["peak_ledger"]["categories"]
    assert led["gradients"] > 0.4 * GiB and led["optimizer_state"] > 0.8 * GiB


def test_story_report_is_self_contained() -> None:
    html = render_report(load("gpu-bert-base-b32-s512-8gib-oom"))
    assert "Content-Security-Policy" in html
    assert 'src="http' not in html and 'href="http' not in html
