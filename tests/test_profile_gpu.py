"""``memdoctor profile --gpu NAME`` end to end on the CPU, and a fp16 plan for the card applied the way
``memdoctor run`` applies it (issue 16, point 2).

On the CPU a run cannot be capped to the card's memory: ``--gpu`` then plans for the card's size and
features from what the run measured, and says so. The fp16 runs are real on the CPU: fp16 autocast
and ``torch.amp.GradScaler("cpu")`` (torch 2.13), no fake. The CUDA cap itself
(``set_per_process_memory_fraction`` to the card's usable memory, as ``--budget`` applies it) is
measured on the device by ``benchmarks/card_plan_rtx2070.py``.
"""

from __future__ import annotations

import gzip
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memdoctor.cards import find_card
from memdoctor.config import from_plan, load_config
from memdoctor.config.file import dump_config
from memdoctor.levers.install import install
from memdoctor.plan.planner import make_plan
from memdoctor.plan.target import Target
from tests.test_plan import hand_workload

REPO = Path(__file__).resolve().parent.parent
PLAIN = Path(__file__).parent / "scripts" / "run_plain.py"
RTX2070 = find_card("rtx2070")


def _memdoctor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "memdoctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_profile_gpu_on_the_cpu_plans_fp16_for_the_card_and_run_scales_its_loss(tmp_path: Path) -> None:
    """``profile --gpu rtx2070 --budget 100KiB``: the smaller memory, the card's features (fp16 with a
    GradScaler: the tiny loop's ranges are fp16-safe, the card has no bf16), recorded in the trace and
    named in the report; then ``memdoctor run`` of its memdoctor.yaml drives the GradScaler every step."""
    out = tmp_path / "report"
    args = ["--steps", "5", "--out", str(tmp_path / "run.json")]
    prof = _memdoctor(
        "profile", "--gpu", "rtx2070", "--budget", "100KiB", "--steps", "3", "-o", str(out), str(PLAIN),
        "--", *args, cwd=tmp_path,
    )  # fmt: skip
    assert prof.returncode == 0, prof.stderr
    assert "note: --gpu rtx2070: this run trained on the cpu, whose memory cannot be capped" in prof.stderr
    with gzip.open(out / "trace.jsonl.gz", "rt") as fh:
        header = json.loads(fh.readline())
    assert header["settings"]["gpu"] == "rtx2070" and header["settings"]["budget_bytes"] == 100 * 1024
    summary = json.loads((out / "summary.json").read_text())
    plan = summary["plan"]
    assert summary["gpu"] == "rtx2070" and plan["card"] == "GeForce RTX 2070"
    assert plan["config"]["precision"] == "fp16" and plan["grad_scaler"] is not None
    html = (out / "report.html").read_text()
    assert "Measured on the CPU (not capped" in html and "planned for the GeForce RTX 2070" in html
    assert f"memdoctor plan --gpu t4 {out / 'trace.jsonl.gz'} -o {out / 'memdoctor-t4.yaml'}" in html
    config = load_config(out / "memdoctor.yaml")
    assert config.precision == "fp16" and config.provenance.trace == "trace.jsonl.gz"
    run = _memdoctor("run", "--config", str(out / "memdoctor.yaml"), str(PLAIN), "--", *args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "autocast fp16 with loss scaling around TinyClassifier.forward" in run.stderr
    assert "fp16 loss scaling: 5 optimizer step(s) through torch.amp.GradScaler" in run.stderr
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 5


def test_profile_gpu_refuses_an_unknown_card_before_running(tmp_path: Path) -> None:
    got = _memdoctor("profile", "--gpu", "rtx9999", str(PLAIN), cwd=tmp_path)
    assert got.returncode == 2 and "unknown GPU 'rtx9999': --gpu takes one of rtx2070" in got.stderr
    assert not (tmp_path / "memdoctor-report").exists()


# ----------------------------------------------------------------------------------------- memdoctor run


def test_a_fp16_plan_for_the_card_runs_with_a_grad_scaler_that_scales_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain a user follows: the planner's fp16 plan for the RTX 2070, its memdoctor.yaml, and the
    installation ``memdoctor run`` makes, on an unmodified tiny loop: every optimizer step goes through
    a real ``torch.amp.GradScaler`` on the CPU, which multiplies the loss by the planned scale."""
    w = hand_workload(
        precision_verdict="fp16_safe",
        candidates=[],
        scale_window_log2=(10, 12),
        suggested_scale_log2=12,
        compute_class="high",
    )
    plan = make_plan(w, Target(950, RTX2070, margin=0.0))  # 1000 measured
    assert plan.chosen is not None and plan.chosen.config.precision == "fp16"
    k = plan.chosen.config.accumulation_steps  # the planner adds micro-batches of 1/2: each loss scaled
    path = tmp_path / "memdoctor.yaml"
    path.write_text(dump_config(from_plan(plan.as_dict())))
    config = load_config(path)
    scaled: list[tuple[float, float]] = []
    real_scale = torch.amp.GradScaler.scale

    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        out = real_scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and outputs.requires_grad:
            scaled.append((float(outputs.detach()), float(out.detach())))
        return out

    monkeypatch.setattr(torch.amp.GradScaler, "scale", scale)
    lines: list[str] = []
    inst = install(config.as_dict(), say=lines.append)
    monkeypatch.setattr(sys, "argv", [str(PLAIN), "--steps", "3", "--out", str(tmp_path / "run.json")])
    try:
        runpy.run_path(str(PLAIN), run_name="__main__")
        notes = inst.finish()
    finally:
        inst.remove()
    assert any("torch.amp.GradScaler, init_scale=4096, growth_interval=500" in line for line in lines)
    assert len(scaled) == 3 * k and all(big == pytest.approx(loss * 4096.0) for loss, big in scaled)
    assert (
        "fp16 loss scaling: 3 optimizer step(s) through torch.amp.GradScaler, scale 4096 at the start"
        in (notes[-1])
    )
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 3
