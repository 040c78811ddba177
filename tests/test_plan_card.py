"""Plans for the card (issue 16, point 2): ``--gpu NAME`` plans with the named card's features from the one
GPU table, not the profiled GPU's: fp16 with its GradScaler where a card has no bf16 (Turing, Volta), its
PCIe rate for offload, its FLOP rate for the time model; ``--gpu`` with ``--budget``; the run's recorded
card; the report's sentence and per-card commands; the device benchmark's reading of a run. The fp16
plan applied by ``memdoctor run`` is tests/test_profile_gpu.py's."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from memdoctor.cards import CARDS, find_card
from memdoctor.cli import main
from memdoctor.cli.profile import card_budget
from memdoctor.config import load_config
from memdoctor.errors import UsageError
from memdoctor.launch.profile_child import ENV_VAR
from memdoctor.launch.supervisor import _child_env
from memdoctor.plan.config import Config
from memdoctor.plan.model import predict, workload
from memdoctor.plan.planner import card_table, make_plan
from memdoctor.plan.summarize import summary_target
from memdoctor.plan.target import Target
from memdoctor.plan.tiers import tier_one, tier_two
from memdoctor.plan.timing import amp_time_factor
from memdoctor.report import build_summary
from memdoctor.report.sections.plan import card_rows, measured_for
from memdoctor.trace import Trace, load_trace, run_settings
from tests.test_cli import FakeSupervisor
from tests.test_plan import hand_workload
from tests.tracebuilder import GiB, MiB

DATA = Path(__file__).parent / "data"
BERT32 = DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"  # H200, fp32, precision verdict fp16_safe
REPO = Path(__file__).resolve().parent.parent
RTX2070 = find_card("rtx2070")


@pytest.fixture(scope="module")
def bert32() -> tuple[Trace, dict[str, Any]]:
    trace = load_trace(BERT32)
    return trace, build_summary(trace)


def _safe(**kw: Any) -> Any:
    return hand_workload(**{"precision_verdict": "fp16_safe", **kw})


# ----------------------------------------------------------------------------------------- the tiers


def test_fp16_is_first_tier_only_on_a_named_card_without_bf16_where_measured_safe() -> None:
    turing = Target(GiB, RTX2070)
    assert turing.fp16_first(_safe())
    assert "fp16" in {c.precision for c in tier_one(_safe(), turing)}
    assert "bf16" not in {c.precision for c in tier_one(_safe(), turing)}  # the card has none
    assert not {c.precision for c in tier_two(_safe(), turing)} - {"fp32", "fp16"}
    assert all(c.optimizer == "8bit" for c in tier_two(_safe(), turing))  # its fp16 was tier one's
    assert Target(GiB, find_card("v100")).fp16_first(_safe())  # Volta: fp16 tensor cores, no bf16
    assert not Target(GiB, find_card("rtx3060")).fp16_first(_safe()), "Ampere: bf16 instead"
    assert not Target(GiB).fp16_first(_safe(bf16_native=False)), "no card named: the trace cannot say"
    assert not turing.fp16_first(hand_workload(precision_verdict="bf16_only"))
    assert not turing.fp16_first(_safe(script_autocast="bf16")), "the script's own autocast is kept"
    assert not turing.fp16_first(_safe(has_optimizer=False)), "no optimizer to drive the GradScaler"


def test_the_story_plans_fp16_with_a_grad_scaler_for_the_rtx2070(
    bert32: tuple[Trace, dict[str, Any]],
) -> None:
    """BERT-base b32 s512 profiled on the H200: for the H200's own budget bf16 (its native 16 bits), for
    the RTX 2070 (no bf16) fp16 with the GradScaler the measured ranges set, never bf16."""
    w = workload(*bert32)
    assert w is not None and w.precision_verdict == "fp16_safe"
    turing = make_plan(w, Target(RTX2070.usable_bytes, RTX2070))
    assert turing.chosen is not None and turing.chosen.config.precision == "fp16"
    doc = turing.as_dict()
    assert doc["card"] == "GeForce RTX 2070" and doc["grad_scaler"]["init_scale"] == 2.0**16
    assert make_plan(w, Target(8 * GiB)).chosen.config.precision == "bf16"  # type: ignore[union-attr]
    ampere = find_card("rtx3060")
    plan = make_plan(w, Target(ampere.usable_bytes, ampere)).chosen
    assert plan is not None and plan.config.precision == "bf16"
    rows = {r["gpu"]: r for r in card_table(w)}
    assert not any("bf16" in lever for lever in rows["rtx2070"]["levers"])
    assert "fp16 autocast" in rows["rtx2070"]["levers"]


def test_offload_costs_use_the_named_cards_pcie_rate() -> None:
    w = hand_workload(offload_bytes_per_s=50e9)  # the profiled host link (an H200's Gen5)
    p = predict(w, Config(optimizer="offload"), offload_bytes_per_s=Target(GiB, RTX2070).link(w))
    assert p.time_parts["offload"] == pytest.approx(1e3 * 200 / RTX2070.pcie_bytes_per_s)
    assert "PCIe datasheet rate" in p.time_basis["offload"]


# ----------------------------------------------------------------------------------------- time model


def test_the_time_model_uses_the_named_cards_flop_rate() -> None:
    """The measured share of matmuls is the profiled GPU's; for a named card it is re-weighed by the two
    cards' fp32 rates and bandwidths, and the speed-up is the card's own 16-bit / fp32 ratio."""
    w = hand_workload(device_name="NVIDIA H200", peak_fraction=0.4, compute_class="high")
    own, why = amp_time_factor(w, "bf16")
    assert "re-weighed" not in why and own < 1.0
    t4, why = amp_time_factor(w, "fp16", "Tesla T4")
    h200 = device_peaks_of("H200")
    card = find_card("t4").peaks
    assert card is not None
    share = 0.4 * 100 / 80
    matmul, rest = share * h200.float32 / card.float32, (1 - share) * h200.bandwidth / card.bandwidth
    moved = matmul / (matmul + rest)
    speedup = card.float16 / card.float32 * 0.5
    assert t4 == pytest.approx(moved / speedup + (1 - moved) * 0.9)
    assert "T4 datasheet" in why and "re-weighed from the profiled H200" in why
    # TF32 on the H200: its fp32 matmuls ran at half its 16-bit peak, so they took a smaller share there
    tf32 = dataclasses.replace(w, script_tf32=True)
    with_tf32, _ = amp_time_factor(tf32, "fp16", "GeForce RTX 2070")
    without, _ = amp_time_factor(w, "fp16", "GeForce RTX 2070")
    assert with_tf32 > without, "less matmul time measured: less for fp16 to speed up"


def device_peaks_of(name: str) -> Any:
    return next(c.peaks for c in CARDS if c.name == name)


# ----------------------------------------------------------------------------------------- --gpu, --budget


def test_gpu_and_budget_together_take_the_smaller_memory() -> None:
    assert card_budget("rtx2070", None) == RTX2070.usable_bytes
    assert card_budget("rtx2070", 6 * GiB) == 6 * GiB
    assert card_budget("rtx2070", 64 * GiB) == RTX2070.usable_bytes
    assert card_budget(None, 6 * GiB) == 6 * GiB
    with pytest.raises(UsageError, match="unknown GPU 'rtx9999'"):
        card_budget("rtx9999", None)


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeSupervisor:
    """test_cli's fake ``run_profile``: records the request; cwd = tmp, with a train.py."""
    fake = FakeSupervisor()
    monkeypatch.setattr("memdoctor.launch.supervisor.run_profile", fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")
    return fake


def test_profile_gpu_asks_the_child_to_cap_to_the_card(supervisor: FakeSupervisor) -> None:
    """The request the supervisor gets: the card's usable memory as the budget (the child caps to it with
    ``set_per_process_memory_fraction``, ``CudaDevice.apply_cap``, as for ``--budget``) and the card."""
    assert main(["profile", "--gpu", "RTX 2070", "--budget", "64GiB", "train.py"]) == 0
    req = supervisor.request
    assert (req.budget_bytes, req.gpu) == (RTX2070.usable_bytes, "rtx2070")
    cfg = json.loads(_child_env(req, Path("trace.partial"))[ENV_VAR])
    assert (cfg["budget_bytes"], cfg["gpu"]) == (RTX2070.usable_bytes, "rtx2070")


def test_the_run_settings_record_the_card_only_when_named() -> None:
    assert run_settings(1, 5, None) == {"warmup": 1, "steps": 5, "budget_bytes": None}
    assert run_settings(1, 5, 7 * GiB, "rtx2070")["gpu"] == "rtx2070"


def test_a_run_profiled_for_a_card_is_planned_for_it() -> None:
    target = summary_target({"gpu": "rtx2070", "budget_bytes": 6 * GiB, "device": {"kind": "cuda"}})
    assert target is not None and target.card == RTX2070 and target.budget_bytes == 6 * GiB
    cpu = summary_target({"gpu": "t4", "budget_bytes": None, "device": {"kind": "cpu"}})
    assert cpu is not None and cpu.card == find_card("t4") and cpu.budget_bytes == cpu.card.usable_bytes
    old = summary_target({"gpu": "a-card-of-the-future", "budget_bytes": 6 * GiB})
    assert old is not None and old.card is None and old.budget_bytes == 6 * GiB


def test_plan_gpu_with_budget_writes_the_named_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cards" / "memdoctor-rtx2070.yaml"
    code = main(["plan", "--gpu", "rtx2070", "--budget", "6GiB", str(BERT32), "--json", "-o", str(out)])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["budget_bytes"] == 6 * GiB and doc["plan"]["card"] == "GeForce RTX 2070"
    assert doc["plan"]["config"]["precision"] == "fp16"
    config = load_config(out)
    assert config.precision == "fp16" and config.grad_scaler is not None
    assert config.grad_scaler.init_scale == 2.0**16
    assert main(["plan", "--gpu", "rtx2070", str(BERT32), "-o", str(out)]) == 2, (
        "no overwrite without --force"
    )


# ----------------------------------------------------------------------------------------- the report


def test_the_report_says_which_gpu_measured_and_which_card_the_plan_is_for(
    bert32: tuple[Trace, dict[str, Any]],
) -> None:
    _, summary = bert32
    planned = {**summary, "plan": {"card": "GeForce RTX 2070", "budget_bytes": RTX2070.usable_bytes}}
    text = measured_for({**planned, "device": {**summary["device"], "memory_cap_bytes": 7 * GiB + 512 * MiB}})
    assert text is not None
    assert text.startswith("Measured on NVIDIA H200, capped to 7.50 GiB; planned for the GeForce RTX 2070")
    assert "no bf16 (compute capability 7.5): fp16 with a GradScaler" in text
    assert "PCIe Gen3 at 12.6 GB/s" in text and "7.5 TFLOP/s fp32" in text
    cpu = measured_for({**planned, "device": {"kind": "cpu", "name": "x86_64"}})
    assert cpu is not None and cpu.startswith("Measured on the CPU (not capped")
    own = measured_for({**summary, "plan": {"card": None, "budget_bytes": 8 * GiB}})
    assert own is not None and "with the measured device's own features" in own
    assert measured_for({**summary, "plan": None}) is None


def test_every_card_row_carries_a_command_with_absolute_paths(
    bert32: tuple[Trace, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, _ = bert32
    w = workload(*bert32)
    assert w is not None
    rows = card_rows(trace, card_table(w))
    assert len(rows) == len(CARDS)
    words = shlex.split(rows[0]["command"])
    assert words[:4] == ["memdoctor", "plan", "--gpu", "rtx2070"]
    assert Path(words[4]).is_absolute() and Path(words[4]).resolve() == BERT32.resolve()
    assert words[5] == "-o" and words[6] == str(Path(words[4]).parent / "memdoctor-rtx2070.yaml")
    assert {shlex.split(r["command"])[3] for r in rows} == {c.key for c in CARDS}
    monkeypatch.chdir(tmp_path)  # the command works from another folder (its -o pointed here)
    assert main([*words[1:6], str(tmp_path / "x.yaml"), "--json"]) == 0
    assert load_config(tmp_path / "x.yaml").precision == "fp16"


# ----------------------------------------------------------------------------------------- the benchmark


def test_the_card_benchmark_reads_the_grad_scaler_and_the_peak(tmp_path: Path) -> None:
    """``benchmarks/card_plan_rtx2070.py``'s reading of one ``memdoctor run`` (its CUDA part runs on the
    device only): the GradScaler line, the workload's peak file against the cap, samples/s."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import card_plan_rtx2070 as bench

    (tmp_path / "peak.json").write_text(json.dumps({"max_reserved_bytes": 7 * GiB, "oom": False}))
    steps = "".join(json.dumps({"step": i, "step_ms": 100.0 + (i == 1) * 900}) + "\n" for i in (1, 2, 3))
    (tmp_path / "steps.jsonl").write_text(steps)
    text = (
        "memdoctor: applying memdoctor.yaml (planned to fit)\nmemdoctor: fp16 loss scaling: 20 optimizer "
        "step(s) through torch.amp.GradScaler, scale 65536 at the start, 32768 at the end\n"
    )
    got = bench.run_measurements(text, 0, tmp_path, RTX2070.usable_bytes, False, 1.0)
    assert got["status"] == "ok" and got["grad_scaler_active"] and got["grad_scaler_steps"] == 20
    assert got["grad_scaler_scale"] == [65536.0, 32768.0] and got["within_cap"] is True
    assert got["samples_per_s"] == pytest.approx(320.0)  # 32 x 1000 / 100 ms, step 1 left out
    fp32 = bench.run_measurements("memdoctor: applying memdoctor.yaml\n", 0, tmp_path, 6 * GiB, False, 1.0)
    assert not fp32["grad_scaler_active"] and fp32["within_cap"] is False
    (tmp_path / "peak.json").write_text(json.dumps({"max_reserved_bytes": 7 * GiB, "oom": True}))
    assert bench.run_measurements(text, 1, tmp_path, RTX2070.usable_bytes, False, 1.0)["status"] == "oom"
