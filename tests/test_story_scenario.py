"""The plan-versus-hand-tuning scenarios (``benchmarks/story_scenario.py``): tables and arithmetic.

The scenario itself spawns a dozen processes (the lead runs it on the GPU; ``--tiny`` on a CPU takes
half a minute per workload), so these tests check the cheap parts that decide whether its verdict is fair:
every hand-grid entry keeps the workload's effective batch (parsed by the workload's own argument
parser), the fp32 / low-precision split, samples/s from the step times, and the summary on fake runs.
One in-process Lightning run checks the timing lines are per optimizer step under accumulation.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "workloads"))  # the workloads import each other by name

import story_scenario as sc  # noqa: E402


def _workload(name: str) -> ModuleType:
    return importlib.import_module(Path(sc.WORKLOADS[name].script).stem)


# The effective batch (samples per optimizer step), read from the workload's own parsed arguments.
EFFECTIVE: dict[str, Callable[[argparse.Namespace], int]] = {
    "story": lambda a: a.batch_size if not a.micro_batch or a.batch_size % a.micro_batch == 0 else -1,
    "gpt2-trainer": lambda a: a.batch_size * a.grad_accum,
    "vit-lightning": lambda a: a.batch_size,  # its parser refuses an --accumulate that does not divide
    "resnet-loop": lambda a: a.batch_size if not a.micro_batch or a.batch_size % a.micro_batch == 0 else -1,
    "mini-gpt": lambda a: a.batch_size * a.grad_accum,
}


@pytest.mark.parametrize("name", list(sc.WORKLOADS))
def test_every_grid_entry_keeps_the_effective_batch(name: str) -> None:
    spec, ws = sc.WORKLOADS[name], _workload(name)
    assert set(spec.tiny_grid) <= set(spec.grid) and spec.tiny_grid
    for tiny, batch in ((False, spec.batch), (True, spec.tiny_batch)):
        base = [*spec.args, *(spec.tiny_args if tiny else ())]
        assert EFFECTIVE[name](ws.parse_args(base)) == batch, f"{name} as is (tiny={tiny})"
        for entry, flags in spec.grid.items():
            if tiny and entry not in spec.tiny_grid:
                continue
            assert EFFECTIVE[name](ws.parse_args([*base, *flags])) == batch, f"{name}: {entry} (tiny={tiny})"


def test_the_storys_grid_stays_as_it_was() -> None:
    """The lead's commands in BENCHMARKS.md name these entries."""
    story = sc.WORKLOADS["story"]
    assert story.grid is sc.GRID and story.batch == 32 and story.script == "bert_story.py"
    assert sc.GRID["micro-batch 16 x2"] == ["--micro-batch", "16"]
    assert sc.GRID["bf16, checkpoint every 2nd"] == ["--bf16", "--checkpoint-every", "2"]
    assert len(sc.GRID) == 14


@pytest.mark.parametrize(
    ("name", "entry", "fp32"),
    [
        ("story", "bf16, micro-batch 16 x2", False),
        ("story", "trim padding, checkpoint every 2nd", True),
        ("gpt2-trainer", "bf16, gradient checkpointing", False),
        ("gpt2-trainer", "micro-batch 4 x4", True),
        ("vit-lightning", "bf16-mixed, accumulate 2", False),
        ("vit-lightning", "gradient checkpointing, accumulate 2", True),
    ],
)
def test_fp32_entries(name: str, entry: str, fp32: bool) -> None:
    spec = sc.WORKLOADS[name]
    assert spec.fp32(spec.grid[entry]) is fp32


def test_parse_args_per_workload() -> None:
    story = sc.parse_args([])
    assert (story.workload, story.out, story.steps, story.grid) == ("story", Path("story-scenario"), 12, None)
    gpt2 = sc.parse_args(["--workload", "gpt2-trainer", "--tiny", "--grid", "bf16; micro-batch 8 x2"])
    assert gpt2.out == Path("gpt2-trainer-scenario") and gpt2.steps == 4
    assert gpt2.grid == ("bf16", "micro-batch 8 x2")
    with pytest.raises(SystemExit):  # the BERT workload's entry is not in the Lightning grid
        sc.parse_args(["--workload", "vit-lightning", "--grid", "micro-batch 16 x2"])


def test_run_arguments_carry_the_workload(tmp_path: Path) -> None:
    args = sc.parse_args(["--workload", "gpt2-trainer", "--out", str(tmp_path)])
    flags = sc.workload_args(args, tmp_path)
    assert flags[:2] == ["--batch-size", "16"] and flags[-2:] == ["--memory-cap-gib", "8.0"]
    assert sc.budget(args) == "8GiB" and sc.script(args).endswith("gpt2_trainer.py")
    tiny = sc.parse_args(["--workload", "vit-lightning", "--tiny", "--out", str(tmp_path)])
    assert "--tiny" in sc.workload_args(tiny, tmp_path, cap=False)
    assert sc.budget(tiny) == "3MiB" and sc.batch_size(tiny) == 16


def _steps(d: Path, ms: list[float]) -> None:
    lines = [json.dumps({"step": i + 1, "step_ms": v}) for i, v in enumerate(ms)]
    (d / "steps.jsonl").write_text("\n".join(lines) + "\n")


def test_samples_per_s_is_the_effective_batch_over_the_median_step(tmp_path: Path) -> None:
    args = sc.parse_args(["--workload", "gpt2-trainer", "--out", str(tmp_path)])
    _steps(tmp_path, [900.0] + [100.0] * 4 + [200.0] * 5)  # step 1 (start-up) is left out
    (tmp_path / "peak.json").write_text(json.dumps({"max_reserved_bytes": 7, "oom": False}))
    run = sc.Run("x", "hand", [], status="ok")
    sc.read_measurements(run, args, tmp_path)
    assert run.step_ms == 200.0  # the median of the last 8 of steps 2..10: 3 x 100, 5 x 200
    assert run.samples_per_s == 16 * 1000 / 200.0 and run.max_reserved_bytes == 7
    (tmp_path / "peak.json").write_text(json.dumps({"max_reserved_bytes": 9, "oom": True}))
    died = sc.Run("y", "bare", [], status="failed")
    sc.read_measurements(died, args, tmp_path)
    assert died.status == "oom" and died.samples_per_s is None


def test_summarize_compares_memdoctor_with_the_best_hand_configs(tmp_path: Path) -> None:
    args = sc.parse_args(["--workload", "vit-lightning", "--out", str(tmp_path)])
    runs = [
        sc.Run("as is", "bare", [], status="oom"),
        sc.Run("memdoctor profile", "profile", [], status="ok"),
        sc.Run("memdoctor run --config", "memdoctor", [], status="ok", samples_per_s=90.0),
        sc.Run("accumulate 2 (32 x2)", "hand", [], status="ok", samples_per_s=100.0),
        sc.Run("bf16-mixed", "hand", [], status="ok", samples_per_s=300.0, fp32=False),
        sc.Run("accumulate 4 (16 x4)", "hand", [], status="oom"),
    ]
    result = sc.summarize(args, runs)
    assert (result["workload"], result["batch"], result["bare_ooms"]) == ("vit-lightning", 64, True)
    assert result["best_hand"] == "bf16-mixed" and result["ratio"] == 0.3
    assert result["best_hand_fp32"] == "accumulate 2 (32 x2)" and result["ratio_fp32"] == 0.9
    assert result["plan"] is None and len(result["runs"]) == 6
    json.dumps(result)


def test_new_workload_flags_parse() -> None:
    gpt2, vit = _workload("gpt2-trainer"), _workload("vit-lightning")
    a = gpt2.parse_args(["--gradient-checkpointing", "--memory-cap-gib", "8", "--peak-file", "p.json"])
    assert a.gradient_checkpointing and a.memory_cap_gib == 8.0 and a.peak_file == "p.json"
    assert (a.batch_size, a.seq_len, a.grad_accum) == (8, 512, 1)
    on = gpt2.checkpointing_arguments(True)
    assert gpt2.checkpointing_arguments(False) == {} and True in on.values()
    v = vit.parse_args(["--accumulate", "4", "--precision", "bf16-mixed", "--gradient-checkpointing"])
    assert (v.batch_size, v.accumulate, v.precision, v.gradient_checkpointing) == (64, 4, "bf16-mixed", True)
    assert vit.parse_args(["--tiny"]).batch_size == 4
    with pytest.raises(SystemExit):
        vit.parse_args(["--batch-size", "64", "--accumulate", "3"])


def test_capped_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORY_MEMORY_CAP_GIB", "6")
    assert _workload("gpt2-trainer").parse_args([]).memory_cap_gib == 6.0
    assert _workload("vit-lightning").parse_args([]).memory_cap_gib == 6.0


def test_vit_lightning_checkpoints_and_times_each_optimizer_step(tmp_path: Path) -> None:
    vit = _workload("vit-lightning")
    config = vit.build_config(tiny=True)
    assert vit.ViTClassifier(config, 1e-4, True).model.is_gradient_checkpointing
    assert not vit.ViTClassifier(config, 1e-4, False).model.is_gradient_checkpointing
    timing, peak = tmp_path / "steps.jsonl", tmp_path / "peak.json"
    files = ["--timing-file", str(timing), "--peak-file", str(peak)]
    vit.main(
        ["--tiny", "--device", "cpu", "--steps", "3", "--accumulate", "2", "--gradient-checkpointing", *files]
    )
    records = [json.loads(line) for line in timing.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["step_ms"] > 0 for r in records)
    assert json.loads(peak.read_text()) == {
        "max_reserved_bytes": None,
        "max_allocated_bytes": None,
        "oom": False,
        "steps": 3,
    }
