"""``memdoctor.levers.frameworks``: the plan through the HF Trainer's and Lightning's own arguments.

The tiny training scripts (tests/scripts/fw_*.py) are run as-is and under ``patch_frameworks``; they dump
what the Trainer actually used (its arguments, the micro-batch sizes the model saw, the optimizer-step
count, the weights after training with SGD, which equal only when the gradients do).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch.trainer.connectors.data_connector as pl_data
import lightning.pytorch.trainer.trainer as pl_trainer
import pytest
import pytorch_lightning.trainer.connectors.data_connector as ptl_data
import pytorch_lightning.trainer.trainer as ptl_trainer
import torch
import transformers.trainer as hf_trainer
import transformers.training_args as hf_args
from torch.utils.data import BatchSampler, SequentialSampler

from memdoctor.config import DataLoaderSettings, PlanConfig
from memdoctor.levers import FrameworkPatch, frameworks_lightning
from memdoctor.levers.frameworks import MicroBatchSampler, patch_frameworks
from memdoctor.levers.frameworks_lightning import trainer_kwargs
from memdoctor.levers.frameworks_state import FrameworkState

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parent.parent


def run(script: str, tmp_path: Path, *argv: str, config: PlanConfig | None = None) -> dict[str, Any]:
    """Run ``tests/scripts/<script>`` in this process (under the config's patches when given)."""
    out = tmp_path / f"{script}-{len(list(tmp_path.iterdir()))}.json"
    patch = patch_frameworks(config, announce=lambda line: None) if config is not None else None
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = [str(SCRIPTS / script), str(out), *argv]
    os.chdir(tmp_path)  # Lightning may write beside the script's working directory
    try:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        if patch is not None:
            patch.undo()
    result: dict[str, Any] = json.loads(out.read_text())
    result["patch"] = patch
    return result


def close(a: list[float], b: list[float], atol: float) -> bool:
    return bool(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol))


# ----------------------------------------------------------------------------------------- HF


def test_hf_accumulation_through_the_script_s_own_arguments_is_not_split_again(tmp_path: Path) -> None:
    """``accumulation_split: arguments``: the script's own ``--batch 4 --gas 2`` (which ``memdoctor run``
    adds) set the Trainer's batch and accumulation; the Trainer's switch must not halve them again (GPT-2
    on the H200 ran at 1/4 while the plan scaled it by 2)."""
    config = PlanConfig(
        accumulation_steps=2, accumulation_split="arguments", script_args=("--batch", "4", "--gas", "2")
    )
    got = run("fw_hf_trainer.py", tmp_path, "--batch", "4", "--gas", "2", config=config)
    assert (got["per_device_train_batch_size"], got["gradient_accumulation_steps"]) == (4, 2)
    assert "accumulation" not in got["patch"].handled
    state = FrameworkState(config, announce=lambda line: None)
    kwargs, armed = trainer_kwargs(state, {"accumulate_grad_batches": 2, "max_steps": 3})
    assert kwargs == {"accumulate_grad_batches": 2, "max_steps": 3} and armed is None


@pytest.mark.parametrize("samples", [24, 20])  # 20: the epoch ends on a partial batch of 4
def test_hf_accumulation_keeps_batch_steps_schedule_and_gradients(tmp_path: Path, samples: int) -> None:
    base = run("fw_hf_trainer.py", tmp_path, "--samples", str(samples))
    got = run(
        "fw_hf_trainer.py", tmp_path, "--samples", str(samples), config=PlanConfig(accumulation_steps=2)
    )
    patch: FrameworkPatch = got["patch"]
    assert (got["per_device_train_batch_size"], got["gradient_accumulation_steps"]) == (4, 2)
    assert base["forward_batch_sizes"] == [8, 8, samples - 16]
    assert got["forward_batch_sizes"] == [4] * (samples // 4)
    assert got["optimizer_steps"] == base["optimizer_steps"] == 3
    assert got["last_lr"] == base["last_lr"]
    assert close(got["weights"], base["weights"], atol=5e-4)  # SGD, lr 0.5: equal gradients
    assert patch.handled == {"accumulation"}
    assert patch.lines == [
        "HF Trainer: per_device_train_batch_size=4 (was 8), gradient_accumulation_steps=2 (was 1): "
        "the same 8 samples per optimizer step per device"
    ]


def test_hf_precision_follows_the_plan_and_says_what_the_script_had(tmp_path: Path) -> None:
    got = run("fw_hf_trainer.py", tmp_path, "--fp16", config=PlanConfig(precision="bf16"))
    assert (got["bf16"], got["fp16"], got["mixed_precision"]) == (True, False, "bf16")
    assert got["patch"].lines == [
        "HF Trainer: bf16=True (the script set fp16=True; the plan's bf16 is used instead)"
    ]
    assert got["patch"].handled == {"precision"}


def test_hf_checkpointing_uses_the_trainer_switch_for_every_kth_layer(tmp_path: Path) -> None:
    plan = PlanConfig(checkpoint=("bert.encoder.layer.0", "bert.encoder.layer.2"))
    got = run("fw_hf_trainer.py", tmp_path, config=plan)
    assert got["gradient_checkpointing"] is True
    assert got["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 2}
    assert got["layer_checkpointing"] == [True, False, True]
    assert got["patch"].handled == {"checkpoint"}
    assert "every 2nd layer" in got["patch"].lines[0]


def test_hf_checkpointing_of_other_modules_is_left_to_the_generic_path(tmp_path: Path) -> None:
    got = run("fw_hf_trainer.py", tmp_path, "--gc", config=PlanConfig(checkpoint=("bert.encoder.layer.1",)))
    assert got["gradient_checkpointing"] is False  # the script's own switch would checkpoint every layer
    assert got["layer_checkpointing"] == [False, False, False]
    assert "checkpoint" not in got["patch"].handled
    assert "generic path" in got["patch"].lines[0] and "turned off" in got["patch"].lines[0]


def _training_arguments(config: PlanConfig, tmp_path: Path, **kwargs: Any) -> tuple[Any, FrameworkPatch]:
    patch = patch_frameworks(config, announce=lambda line: None)
    try:
        args = hf_args.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)
    finally:
        patch.undo()
    return args, patch


def test_hf_data_loader_settings_and_what_cannot_apply(tmp_path: Path) -> None:
    plan = PlanConfig(
        data_loader=DataLoaderSettings(num_workers=2, persistent_workers=True, prefetch_factor=4)
    )
    args, patch = _training_arguments(plan, tmp_path, dataloader_num_workers=1)
    assert (args.dataloader_num_workers, args.dataloader_persistent_workers) == (2, True)
    assert args.dataloader_prefetch_factor == 4
    assert patch.handled == {"data_loader"}
    assert "dataloader_num_workers=2 (the script set 1)" in patch.lines[0]

    refused = PlanConfig(data_loader=DataLoaderSettings(prefetch_factor=4))
    args, patch = _training_arguments(refused, tmp_path)
    assert args.dataloader_prefetch_factor is None
    assert patch.lines == ["HF Trainer: data_loader.prefetch_factor refused: it needs num_workers > 0"]
    assert patch.handled == set()


def test_hf_accumulation_that_does_not_divide_the_batch_is_left_to_the_generic_path(tmp_path: Path) -> None:
    args, patch = _training_arguments(
        PlanConfig(accumulation_steps=4), tmp_path, per_device_train_batch_size=6
    )
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (6, 1)
    assert patch.handled == set()
    assert "not divisible" in patch.lines[0] and "generic path" in patch.lines[0]


def test_the_default_plan_changes_nothing(tmp_path: Path) -> None:
    args, patch = _training_arguments(PlanConfig(), tmp_path, per_device_train_batch_size=6, fp16=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.bf16) == (6, 1, False)
    assert patch.lines == [] and patch.handled == set()


def test_a_micro_batch_planned_for_another_batch_size_is_named(tmp_path: Path) -> None:
    plan = PlanConfig(accumulation_steps=2, micro_batch=16)
    args, patch = _training_arguments(plan, tmp_path, per_device_train_batch_size=8)
    assert args.per_device_train_batch_size == 4  # the script's batch is kept; its half is the micro-batch
    assert "micro_batch=16 was planned for batch size 32, the script's is 8" in patch.lines[0]


# ----------------------------------------------------------------------------------------- Lightning


@pytest.mark.parametrize(
    ("samples", "package"), [(24, "lightning.pytorch"), (20, "lightning.pytorch"), (20, "pytorch_lightning")]
)
def test_lightning_accumulation_splits_each_batch_and_keeps_steps_and_gradients(
    tmp_path: Path, samples: int, package: str
) -> None:
    argv = ("--samples", str(samples), "--package", package)
    base = run("fw_lightning.py", tmp_path, *argv)
    got = run("fw_lightning.py", tmp_path, *argv, config=PlanConfig(accumulation_steps=2))
    assert got["accumulate_grad_batches"] == 2
    assert base["batch_sizes"] == [8, 8, samples - 16]
    assert got["batch_sizes"] == [4] * 4 + [(samples - 16) // 2] * 2
    assert got["optimizer_steps"] == base["optimizer_steps"] == 3
    assert close(got["weights"], base["weights"], atol=1e-6)  # same samples, same order, same gradients
    assert got["patch"].handled == {"accumulation"}
    assert got["patch"].lines[-1] == "Lightning: training DataLoader batch size 8 -> 2 micro-batches of 4"


def test_lightning_precision(tmp_path: Path) -> None:
    got = run("fw_lightning.py", tmp_path, config=PlanConfig(precision="bf16"))
    assert got["precision"] == "bf16-mixed"
    assert got["patch"].lines == ["Lightning: precision='bf16-mixed'"]
    assert got["patch"].handled == {"precision"}


def test_lightning_precision_conflict_follows_the_plan_and_says_so() -> None:
    state = FrameworkState(PlanConfig(precision="bf16"), announce=lambda line: None)
    kwargs, armed = trainer_kwargs(state, {"precision": "16-mixed", "max_steps": 3})
    assert kwargs == {"precision": "bf16-mixed", "max_steps": 3} and armed is None
    assert state.lines == [
        "Lightning: precision='bf16-mixed' (the script set '16-mixed'; the plan's is used)"
    ]


def test_lightning_loader_it_cannot_rebuild_refuses_accumulation_by_name(tmp_path: Path) -> None:
    base = run("fw_lightning.py", tmp_path)
    got = run("fw_lightning.py", tmp_path, "--loader", "subclass", config=PlanConfig(accumulation_steps=2))
    assert got["accumulate_grad_batches"] == 1  # back to the script's: the effective batch is kept
    assert got["batch_sizes"] == [8, 8, 8]
    assert got["optimizer_steps"] == base["optimizer_steps"]
    assert (
        got["patch"]
        .lines[-1]
        .startswith("Lightning: accumulation refused: the training loader is a MyLoader")
    )
    assert got["patch"].handled == {"accumulation"}  # taken over, and refused by name


def test_lightning_loader_that_fails_to_rebuild_keeps_the_scripts_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(loader: Any, batch_sampler: Any) -> Any:
        raise TypeError("unexpected keyword argument 'in_order'")

    monkeypatch.setattr(frameworks_lightning, "_rebuild", refuse)
    got = run("fw_lightning.py", tmp_path, config=PlanConfig(accumulation_steps=2))
    assert (got["accumulate_grad_batches"], got["batch_sizes"]) == (1, [8, 8, 8])
    assert "could not be rebuilt (TypeError: unexpected keyword" in got["patch"].lines[-1]


@pytest.mark.parametrize(
    ("size", "batch", "n", "drop_last"),
    [(24, 8, 2, False), (20, 8, 4, False), (21, 8, 3, True), (3, 8, 4, False)],
)
def test_micro_batch_sampler_splits_every_batch_in_order(
    size: int, batch: int, n: int, drop_last: bool
) -> None:
    batches = BatchSampler(SequentialSampler(range(size)), batch, drop_last)
    micro = list(MicroBatchSampler(batches, n))
    assert len(MicroBatchSampler(batches, n)) == len(micro)
    merged, i = [], 0
    for original in batches:  # n consecutive micro-batches (fewer for a batch smaller than n) are one batch
        parts = micro[i : i + min(n, len(original))]
        merged.append([j for part in parts for j in part])
        i += len(parts)
    assert merged == list(batches) and i == len(micro)


# ----------------------------------------------------------------------------------------- undo, laziness


def _patchable() -> list[Any]:
    return [
        hf_args.TrainingArguments.__dict__["__post_init__"],
        hf_trainer.Trainer.__dict__["__init__"],
        pl_trainer.Trainer.__dict__["__init__"],
        pl_data._DataConnector.__dict__["_prepare_dataloader"],
        ptl_trainer.Trainer.__dict__["__init__"],
        ptl_data._DataConnector.__dict__["_prepare_dataloader"],
    ]


def test_undo_restores_every_patched_class() -> None:
    originals, finders = _patchable(), list(sys.meta_path)
    patch = patch_frameworks(PlanConfig(accumulation_steps=2, precision="bf16"), announce=lambda line: None)
    assert all(now is not before for now, before in zip(_patchable(), originals, strict=True))
    patch.undo()
    assert _patchable() == originals
    assert sys.meta_path == finders


def test_patches_apply_on_import_and_cost_nothing_before(tmp_path: Path) -> None:
    """In a fresh interpreter: nothing imported at patch time; the script's own import is patched."""
    out = tmp_path / "hf.json"
    code = f"""
import runpy, sys
from memdoctor.config import PlanConfig
from memdoctor.levers.frameworks import patch_frameworks
patch = patch_frameworks(PlanConfig(accumulation_steps=2), announce=lambda line: None)
assert not any(m.split('.')[0] in ('transformers', 'lightning', 'pytorch_lightning') for m in sys.modules)
sys.argv = [{str(SCRIPTS / "fw_hf_trainer.py")!r}, {str(out)!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
import transformers.training_args as t
assert type(t.__loader__).__name__ != "_HookedLoader" and t.__spec__.loader is t.__loader__
print("LINES", patch.lines)
patch.undo()
assert "_memdoctor" not in repr(sys.meta_path)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gradient_accumulation_steps=2 (was 1)" in proc.stdout
    assert json.loads(out.read_text())["gradient_accumulation_steps"] == 2


def test_an_unexpected_error_is_said_and_never_raised_into_the_script() -> None:
    state = FrameworkState(PlanConfig(accumulation_steps=2), announce=lambda line: None)
    state.loader_hook = True
    kwargs = {"accumulate_grad_batches": "every other"}  # not a number: int() raises inside the patch
    assert state.guard("Lightning Trainer", trainer_kwargs, state, kwargs) is None
    assert state.lines == [
        "Lightning Trainer: not (fully) applied: ValueError: invalid literal for int() with base 10: "
        "'every other'; the rest stays the script's own"
    ]
    assert state.handled == set()  # nothing taken over: the generic path may still apply it
