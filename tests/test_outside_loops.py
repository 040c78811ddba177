"""``memdoctor profile`` and ``memdoctor run`` end to end on loops of outside shapes (tests/scripts/
loop_*.py, which know nothing of memdoctor): a loop that updates its parameters by hand, and a
dcgan-shaped GAN whose two models have modules of the same names. The in-process checks of the same
shapes are tests/test_steps_found.py; these start processes, so they stay out of the fast subset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memdoctor.cards import find_card
from memdoctor.config import dump_config, from_plan
from memdoctor.plan.summarize import doctor
from memdoctor.plan.target import Target
from memdoctor.report import build_summary
from memdoctor.trace import load_trace
from tests.test_run import memdoctor_cli

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
# dcgan-shaped, with modules of at least 1 MiB of activations, so that a plan has something to change.
GAN_ARGS = ["--width", "512", "--batch", "512", "--steps", "8"]


def test_a_loop_without_an_optimizer_is_profiled_and_says_how_its_steps_were_found(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = memdoctor_cli("profile", "-o", str(out), str(SCRIPTS / "loop_by_hand.py"), "--", "--evaluate")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_profiled"] == 5
    assert summary["steps_found"]["by"] == "backward"
    assert "steps found" in proc.stdout
    trace = load_trace(out / "trace.jsonl.gz")
    assert [m.cls for m in trace.models] == ["Net"]
    assert all(s.micro_batches == 1 for s in trace.steps)  # the no-grad evaluation is no micro-batch


def test_a_gan_plan_is_applied_to_the_model_it_names_whatever_the_build_order(tmp_path: Path) -> None:
    """dcgan's generator and discriminator both have ``main.0``, ``main.2``: the plan names the modules
    of one, and ``memdoctor run`` must apply it to that one, whichever the script builds first."""
    out = tmp_path / "report"
    script = str(SCRIPTS / "loop_gan.py")
    proc = memdoctor_cli("profile", "-o", str(out), "--budget", "20MiB", script, "--", *GAN_ARGS)
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(out / "trace.jsonl.gz")
    # This GAN's state dominates and only parameter offload names its modules; offload is planned for a
    # CUDA card only (on a CPU run host memory is the device's), so the CPU trace is planned for one,
    # under the same budget, as `memdoctor plan` would for a named card.
    plan = doctor(trace, build_summary(trace), Target(20 * 2**20, card=find_card("rtx2070")))["plan"]
    planned = next(m for m in trace.models if m.index == plan["model"])
    changed = [*plan["config"]["checkpoint"], *plan["config"]["offload_parameters"]]
    assert changed and all(name in planned.names for name in changed)  # plain names, no "model0:"
    config = out / "memdoctor.yaml"
    config.write_text(dump_config(from_plan(plan, trace=trace)))
    assert f"model_class: {planned.cls}" in config.read_text()
    for order in ([], ["--d-first"]):
        run = memdoctor_cli("run", "--config", str(config), script, "--", *GAN_ARGS, "--steps", "2", *order)
        assert run.returncode == 0, run.stderr
        applied = [
            line for line in run.stderr.splitlines() if " modules of " in line or "module(s) of " in line
        ]
        assert applied and all(f"of {planned.cls}" in line for line in applied), (order, run.stderr)
