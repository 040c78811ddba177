"""``memdoctor run``: a memdoctor.yaml applied to unmodified scripts at runtime (memdoctor/runtime).

The scripts (tests/scripts/run_*.py) know nothing of memdoctor: a plain loop over a tiny classifier
that computes its own loss, and an ``accelerate`` loop over a tiny HF BERT. Most tests run them in this
process (``install`` + ``runpy``, then ``remove``: the autouse fixture fails a test that leaves a patch);
a few run the command line as a subprocess, as a user would.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from memdoctor.cli import main
from memdoctor.errors import ConfigError
from memdoctor.levers import FrameworkPatch
from memdoctor.levers import install as install_module
from memdoctor.levers.install import Installation, install
from memdoctor.levers.loader import LoaderSettings
from memdoctor.levers.padding import PaddingTrim

SCRIPTS = Path(__file__).parent / "scripts"
PLAIN = SCRIPTS / "run_plain.py"
ACCELERATE = SCRIPTS / "run_accelerate.py"
REPO = Path(__file__).resolve().parent.parent

# The loss over 20 steps with the whole config (bf16 autocast, checkpointing, accumulation, padding trim,
# DataLoader settings) may differ from the unmodified run's by this much per step (docs/config.md):
# bf16 keeps 8 bits of mantissa, so each logit carries ~0.4% rounding; on this classifier (loss ~0.7)
# the measured largest difference is ~5e-4.
LOSS_TOLERANCE = 0.02
GRAD_RTOL = 1e-5


def run_script(script: Path, args: list[str], config: dict[str, Any] | None = None) -> list[str]:
    """Run ``script`` here as ``python script args`` would, with ``config`` installed; the applied lines."""
    lines: list[str] = []
    inst: Installation | None = None
    argv = sys.argv
    try:
        if config is not None:
            inst = install({"memdoctor_config": 1, **config}, say=lines.append)
        sys.argv = [str(script), *args]
        runpy.run_path(str(script), run_name="__main__")
        if inst is not None:
            inst.finish()
    finally:
        sys.argv = argv
        if inst is not None:
            inst.remove()
    return lines


def grads_close(base: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> list[str]:
    """Names whose gradient differs by more than GRAD_RTOL relative (norm of the difference / norm).

    A few gradients are zero in exact arithmetic (attention key biases: softmax ignores a constant
    shift) and float noise otherwise; those are compared against the whole model's gradient norm."""
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in base.values()))
    bad = []
    for name, g in base.items():
        diff = (g.double() - other[name].double()).norm()
        scale = g.double().norm()
        if scale < 1e-9 * total:
            scale = total
        if diff > GRAD_RTOL * scale:
            bad.append(f"{name}: {float(diff / scale):.2e}")
    return bad


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


# ----------------------------------------------------------------------------------------- faithful


def test_checkpointing_and_accumulation_keep_the_gradients(out: Path) -> None:
    run_script(PLAIN, ["--steps", "1", "--grads", str(out / "base.pt")])
    lines = run_script(
        PLAIN,
        ["--steps", "1", "--grads", str(out / "run.pt")],
        {"checkpoint": ["layers.0", "layers.2"], "accumulation_steps": 3},  # 8 samples: 2 + 3 + 3
    )
    assert lines[0] == "checkpointing 2 modules of TinyClassifier: layers.0 layers.2"
    assert lines[1].startswith("micro-batching: each batch split into 3 micro-batches")
    assert grads_close(torch.load(out / "base.pt"), torch.load(out / "run.pt")) == []


def test_a_batch_smaller_than_the_split_runs_whole(out: Path) -> None:
    run_script(PLAIN, ["--steps", "1", "--batch-size", "3", "--grads", str(out / "base.pt")])
    args = ["--steps", "1", "--batch-size", "3", "--grads", str(out / "run.pt")]
    run_script(PLAIN, args, {"accumulation_steps": 4})
    assert grads_close(torch.load(out / "base.pt"), torch.load(out / "run.pt")) == []


def test_a_script_that_divides_its_loss_still_gets_the_whole_batch_gradients(out: Path) -> None:
    """The held micro-batch gradients follow what the script did with the loss (here: loss / 4)."""
    run_script(PLAIN, ["--steps", "1", "--divide", "4", "--grads", str(out / "base.pt")])
    run_script(
        PLAIN, ["--steps", "1", "--divide", "4", "--grads", str(out / "run.pt")], {"accumulation_steps": 2}
    )
    assert grads_close(torch.load(out / "base.pt"), torch.load(out / "run.pt")) == []


def test_gradients_already_in_grad_are_kept_apart(out: Path) -> None:
    """A script that zeroes instead of freeing .grad: the earlier micro-batches wait aside, not in it."""
    run_script(
        PLAIN, ["--steps", "2", "--zeros", "--grads", str(out / "base.pt"), "--out", str(out / "b.json")]
    )
    args = ["--steps", "2", "--zeros", "--grads", str(out / "run.pt"), "--out", str(out / "r.json")]
    run_script(PLAIN, args, {"accumulation_steps": 2})
    assert grads_close(torch.load(out / "base.pt"), torch.load(out / "run.pt")) == []
    base, run = json.loads((out / "b.json").read_text()), json.loads((out / "r.json").read_text())
    assert abs(base["losses"][1] - run["losses"][1]) < 1e-5


def test_a_training_forward_never_backpropagated_stops_the_run() -> None:
    with pytest.raises(ConfigError, match="accumulation_steps: a training-mode forward's loss was never"):
        run_script(PLAIN, ["--steps", "2", "--peek"], {"accumulation_steps": 2})


def test_accelerate_loop_keeps_the_gradients(out: Path) -> None:
    run_script(ACCELERATE, ["--steps", "1", "--grads", str(out / "base.pt")])
    config = {"checkpoint": ["bert.encoder.layer.0", "bert.encoder.layer.1"], "accumulation_steps": 4}
    lines = run_script(ACCELERATE, ["--steps", "1", "--grads", str(out / "run.pt")], config)
    assert lines[0].startswith("checkpointing 2 modules of BertForSequenceClassification: bert.encoder")
    assert grads_close(torch.load(out / "base.pt"), torch.load(out / "run.pt")) == []


WHOLE = {
    "checkpoint": ["layers.0", "layers.2"],
    "precision": "bf16",
    "accumulation_steps": 2,
    "micro_batch": 4,
    "padding": "trim",
    "data_loader": {"num_workers": 0, "pin_memory": False, "prefetch_factor": 2},
}


def test_the_whole_config_keeps_the_loss_steps_and_lr_schedule(out: Path) -> None:
    run_script(PLAIN, ["--out", str(out / "base.json")])
    lines = run_script(PLAIN, ["--out", str(out / "run.json")], WHOLE)
    base, run = json.loads((out / "base.json").read_text()), json.loads((out / "run.json").read_text())
    assert run["steps"] == base["steps"] == 20
    assert run["lrs"] == base["lrs"]  # one scheduler step per optimizer step, as the script wrote it
    assert max(abs(a - b) for a, b in zip(base["losses"], run["losses"], strict=True)) < LOSS_TOLERANCE
    assert max(run["widths"]) < max(base["widths"])  # the all-padding columns were cut
    assert "autocast bf16 around TinyClassifier.forward" in lines
    assert any(line.startswith("padding: trim: 20 of 20 batches trimmed") for line in lines)
    assert "data_loader: applied to 1 DataLoader(s); prefetch_factor left out where num_workers is 0" in lines


def test_fp16_scales_the_loss_without_the_script_calling_a_grad_scaler(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scales: list[float] = []
    real_step = torch.amp.GradScaler.step

    def step(self: torch.amp.GradScaler, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        scales.append(float(self.get_scale()))
        return real_step(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "step", step)
    run_script(PLAIN, ["--steps", "5", "--clip", "1.0", "--out", str(out / "base.json")])
    config = {"precision": "fp16", "grad_scaler": {"init_scale": 1024, "growth_interval": 2}}
    lines = run_script(PLAIN, ["--steps", "5", "--clip", "1.0", "--out", str(out / "run.json")], config)
    assert lines[0].startswith("autocast fp16 with loss scaling around TinyClassifier.forward")
    assert scales[:3] == [1024.0, 1024.0, 2048.0]  # the script's 5 steps went through the GradScaler
    base, run = json.loads((out / "base.json").read_text()), json.loads((out / "run.json").read_text())
    assert max(abs(a - b) for a, b in zip(base["losses"], run["losses"], strict=True)) < LOSS_TOLERANCE


def test_fp16_with_a_closure_step(out: Path) -> None:
    """``optimizer.step(closure)`` (Lightning's shape): GradScaler takes no closure, so it runs first."""
    run_script(PLAIN, ["--steps", "5", "--out", str(out / "base.json")])
    run_script(PLAIN, ["--steps", "5", "--closure", "--out", str(out / "run.json")], {"precision": "fp16"})
    base, run = json.loads((out / "base.json").read_text()), json.loads((out / "run.json").read_text())
    assert run["steps"] == 5
    assert max(abs(a - b) for a, b in zip(base["losses"], run["losses"], strict=True)) < LOSS_TOLERANCE


# ----------------------------------------------------------------------------------------- bad input


def test_a_stale_config_names_the_missing_modules() -> None:
    with pytest.raises(ConfigError, match=r"lacks: 'encoder.layer.9' \(the config was made for BertModel\)"):
        run_script(
            PLAIN,
            ["--steps", "1"],
            {"checkpoint": ["encoder.layer.9"], "provenance": {"model_class": "BertModel"}},
        )


def test_a_script_whose_model_returns_no_loss_defeats_micro_batching() -> None:
    with pytest.raises(ConfigError, match="accumulation_steps: the model's forward returns no loss"):
        run_script(PLAIN, ["--steps", "1", "--own-loss"], {"accumulation_steps": 2})


def test_a_model_whose_forward_is_not_called_is_named() -> None:
    """The optimizer trains a holder whose forward never runs (a LightningModule calling self.model)."""
    match = r"precision: ModuleDict.forward, which memdoctor wraps, was not called"
    with pytest.raises(ConfigError, match=match):
        run_script(PLAIN, ["--steps", "1", "--holder"], {"precision": "bf16"})


def test_an_attention_implementation_the_model_cannot_take_is_named() -> None:
    with pytest.raises(
        ConfigError, match="attention: sdpa: cannot set it on this model: TinyClassifier has no"
    ):
        run_script(PLAIN, ["--steps", "1"], {"attention": "sdpa"})


def test_an_optimizer_swap_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="optimizer: 8bit: memdoctor run cannot swap"):
        run_script(PLAIN, ["--steps", "1"], {"optimizer": "8bit"})


def test_an_unknown_field_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\nchekpoint: []\n")
    assert main(["run", "--config", str(cfg), str(PLAIN)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'chekpoint'" in err[0]


def test_the_framework_path_is_not_applied_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    undone: list[bool] = []
    patch = FrameworkPatch(["gradient checkpointing through X"], {"checkpoint"}, lambda: undone.append(True))
    monkeypatch.setattr(install_module, "_frameworks", lambda config: patch)
    lines = run_script(PLAIN, ["--steps", "1"], {"checkpoint": ["layers.0"], "precision": "bf16"})
    assert lines == ["gradient checkpointing through X", "autocast bf16 around TinyClassifier.forward"]
    assert undone == [True]


# ----------------------------------------------------------------------------------------- parts


def test_padding_trim_cuts_trailing_padding_only() -> None:
    trim = PaddingTrim()
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    batch = {"input_ids": mask * 7, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    out = trim.trim(batch)
    assert out["input_ids"].shape == (2, 3) and out["labels"].shape == (2,)
    assert batch["input_ids"].shape == (2, 5)  # the loader's batch itself is left alone
    left = torch.tensor([[0, 0, 1], [0, 1, 1]])  # left padding: positions would shift, never trimmed
    assert trim.trim({"input_ids": left, "attention_mask": left})["input_ids"].shape == (2, 3)
    token_labels = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 0]])  # labels in the padding: not -100
    kept = trim.trim({"input_ids": mask, "attention_mask": mask, "labels": token_labels})
    assert kept["labels"].shape == (2, 5)
    assert "1 left whole" in trim.summary()


def test_loader_settings_reach_every_dataloader() -> None:
    from memdoctor.config import DataLoaderSettings

    settings = LoaderSettings(DataLoaderSettings(num_workers=0, pin_memory=False, persistent_workers=True))
    undo = settings.install()
    try:
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=True, num_workers=0)
    finally:
        undo()
    assert loader.pin_memory is False and loader.persistent_workers is False
    assert settings.summary() == (
        "data_loader: applied to 1 DataLoader(s); persistent_workers left out where num_workers is 0"
    )


# ----------------------------------------------------------------------------------------- command line


def memdoctor_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m memdoctor ARGS`` as a user runs it (this worktree's memdoctor first on the path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "memdoctor", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_memdoctor_run_prints_the_parts_and_passes_the_exit_code_on(tmp_path: Path) -> None:
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(PLAIN, work / "train.py")
    cfg = work / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\ncheckpoint: [layers.1]\nprecision: bf16\n")
    before = _digest(work)
    proc = memdoctor_cli(
        "run", "--config", str(cfg), "train.py", "--", "--steps", "2", "--exit", "3", cwd=work
    )
    assert proc.returncode == 3, proc.stderr
    assert "memdoctor: checkpointing 1 modules of TinyClassifier: layers.1" in proc.stderr
    assert "memdoctor: autocast bf16 around TinyClassifier.forward" in proc.stderr
    assert _digest(work) == before  # the script and the config are untouched


def test_memdoctor_run_stops_on_a_stale_config_with_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\ncheckpoint: [bert.encoder.layer.0]\n")
    proc = memdoctor_cli("run", "--config", str(cfg), str(PLAIN), "--steps", "2")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["memdoctor: error: config names modules this model lacks: 'bert.encoder.layer.0'"]


def test_profile_with_a_config_records_it_in_the_trace(tmp_path: Path) -> None:
    from memdoctor.trace import load_trace

    cfg = tmp_path / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\ncheckpoint: [layers.0]\naccumulation_steps: 2\n")
    report = str(tmp_path / "report")
    args = ["--config", str(cfg), "--steps", "2", "--collect", "none", "-o", report]
    proc = memdoctor_cli("profile", *args, str(PLAIN), "--", "--steps", "4")
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(tmp_path / "report" / "trace.jsonl.gz")
    assert trace.header["applied_config"]["checkpoint"] == ["layers.0"]
    applied = [e["message"] for e in trace.events if e["kind"] == "config_applied"]
    assert applied[0] == "checkpointing 1 modules of TinyClassifier: layers.0"
    assert applied[1].startswith("micro-batching: each batch split into 2")


def test_profile_with_a_config_that_cannot_apply_ends_as_config_error(tmp_path: Path) -> None:
    from memdoctor.trace import load_trace

    cfg = tmp_path / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\ncheckpoint: [encoder.layer.0]\n")
    args = ["--config", str(cfg), "--steps", "2", "--collect", "none", "-o", str(tmp_path / "report")]
    proc = memdoctor_cli("profile", *args, str(PLAIN), "--", "--steps", "4")
    assert proc.returncode == 2, proc.stderr
    assert "memdoctor: error: config names modules this model lacks: 'encoder.layer.0'" in proc.stderr
    trace = load_trace(tmp_path / "report" / "trace.jsonl.gz")
    assert trace.end is not None and trace.end["status"] == "config_error"


def test_a_loop_computing_its_loss_is_split_at_the_loader_with_its_schedule_kept(out: Path) -> None:
    """``--own-loss``: the loop computes the loss; the DataLoader split runs its body twice per batch."""
    base_args = ["--steps", "3", "--own-loss", "--clip", "0.5", "--out"]
    run_script(PLAIN, [*base_args, str(out / "base.json")])
    config = {"accumulation_steps": 2, "accumulation_split": "loader"}
    lines = run_script(PLAIN, [*base_args, str(out / "run.json")], config)
    assert any(
        line.startswith("micro-batching: each training DataLoader batch split into 2") for line in lines
    )
    base, run = json.loads((out / "base.json").read_text()), json.loads((out / "run.json").read_text())
    assert run["steps"] == 2 * base["steps"] == 6  # the body runs per micro-batch
    assert run["lrs"][1::2] == base["lrs"]  # the scheduler steps once per batch, as the script's
    assert run["lrs"][0::2] == [1e-2, *base["lrs"][:-1]]  # deferred: unchanged mid-batch
    whole = [(a + b) / 2 for a, b in zip(run["losses"][0::2], run["losses"][1::2], strict=True)]
    assert max(abs(a - b) for a, b in zip(whole, base["losses"], strict=True)) < 1e-5  # same parameters
