"""The several-GPU plan in other tools' terms (issue 17, point 5, exports): accelerate's config file
(FSDP2), the HF Trainer's ``TrainingArguments(fsdp=..., fsdp_config=...)`` and a DeepSpeed ZeRO JSON,
each round-tripped through the tool's own loader where it is installed (accelerate, transformers) or
JSON, and each saying what it cannot express."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from memdoctor.config import PlanConfig, config_for_summary
from memdoctor.config.export import (
    PARALLEL_TOOLS,
    accelerate_config,
    deepspeed_config,
    hf_parallel_arguments,
    not_expressed,
    not_expressed_parallel,
)
from memdoctor.config.file import GradScalerSettings
from memdoctor.config.from_plan import shard_classes
from memdoctor.plan.summarize import doctor
from memdoctor.plan.target import Target
from memdoctor.report import build_summary
from memdoctor.trace import load_trace
from tests.tracebuilder import GiB

pytestmark = pytest.mark.fast

BERT32 = Path(__file__).parent / "data" / "gpu-bert-base-b32-s512-fp32.jsonl.gz"
BLOCKS = tuple(f"bert.encoder.layer.{i}" for i in range(12))


def _fsdp(**kw: Any) -> PlanConfig:
    base: dict[str, Any] = {"gpus": 2, "parallel": "fsdp2", "shard_modules": BLOCKS, "micro_batch": 8}
    return PlanConfig(**{**base, **kw})


def test_shard_classes_come_from_the_traced_model() -> None:
    trace = load_trace(BERT32)
    assert shard_classes(trace, _fsdp()) == ("BertLayer",)
    assert shard_classes(trace, _fsdp(shard_modules=())) == ()


def test_the_accelerate_config_file_loads_in_accelerate(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    cases = {
        "fsdp2": ("FSDP", True, False),
        "fsdp2-no-reshard": ("FSDP", False, False),
    }
    for engine, (kind, reshard, offload) in cases.items():
        doc = accelerate_config(_fsdp(parallel=engine, precision="bf16"), ("BertLayer",))
        path = tmp_path / f"{engine}.yaml"
        path.write_text(yaml.safe_dump(doc))
        loaded = load_config_from_file(str(path))
        assert str(getattr(loaded.distributed_type, "value", loaded.distributed_type)) == kind
        assert loaded.num_processes == 2 and loaded.mixed_precision == "bf16"
        fsdp = loaded.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is reshard
        assert fsdp["fsdp_offload_params"] is offload
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"
    offloaded = accelerate_config(_fsdp(full_offload=True))
    assert offloaded["fsdp_config"]["fsdp_offload_params"] is True
    assert "fsdp_transformer_layer_cls_to_wrap" not in offloaded["fsdp_config"]  # classes not known
    ddp = accelerate_config(PlanConfig(gpus=4, parallel="ddp"))
    assert ddp["distributed_type"] == "MULTI_GPU" and ddp["num_processes"] == 4 and "fsdp_config" not in ddp
    assert accelerate_config(PlanConfig())["distributed_type"] == "NO"


def test_the_hf_fsdp_arguments_build_training_arguments(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    kw = hf_parallel_arguments(_fsdp(parallel="fsdp2-no-reshard", full_offload=False), ("BertLayer",))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, **kw)
    assert args.fsdp_config["version"] == 2 and args.fsdp_config["reshard_after_forward"] is False
    assert args.fsdp_config["cpu_offload"] is False
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["BertLayer"]
    assert hf_parallel_arguments(_fsdp(full_offload=True))["fsdp_config"]["cpu_offload"] is True
    assert hf_parallel_arguments(PlanConfig(gpus=2, parallel="ddp")) == {}  # the Trainer's own under torchrun


def test_the_deepspeed_json_maps_each_engine_to_its_zero_stage() -> None:
    stages = {
        "ddp": 0,
        "fsdp2": 3,
        "fsdp2-no-reshard": 2,
    }
    for engine, stage in stages.items():
        shard = BLOCKS if engine != "ddp" else ()
        doc = json.loads(json.dumps(deepspeed_config(_fsdp(parallel=engine, shard_modules=shard))))
        assert doc["zero_optimization"] == {"stage": stage}
        assert doc["train_micro_batch_size_per_gpu"] == 8 and doc["train_batch_size"] == 16
        assert doc["gradient_accumulation_steps"] == 1
    offload = deepspeed_config(_fsdp(full_offload=True, accumulation_steps=2, micro_batch=4))
    assert offload["zero_optimization"]["stage"] == 3
    assert offload["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["train_batch_size"] == 4 * 2 * 2
    fp16 = deepspeed_config(_fsdp(precision="fp16", grad_scaler=GradScalerSettings(2.0**12, 500)))
    assert fp16["fp16"] == {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500}
    assert deepspeed_config(_fsdp(precision="bf16"))["bf16"] == {"enabled": True}
    one = deepspeed_config(PlanConfig(optimizer="offload"))
    assert one["zero_optimization"]["stage"] == 2 and "offload_param" not in one["zero_optimization"]


def test_each_export_says_what_it_cannot_express() -> None:
    config = _fsdp(parallel="fsdp2-no-reshard", checkpoint=("bert.encoder.layer.3",), precision="bf16")
    for tool in PARALLEL_TOOLS:
        notes = " ".join(not_expressed_parallel(config, tool, ("BertLayer",)))
        assert "gpus: 2" in notes and "checkpoint:" in notes and "precision: bf16" in notes
    deepspeed = " ".join(not_expressed_parallel(config, "deepspeed"))
    assert "ZeRO-2 keeps every parameter whole on every rank" in deepspeed
    assert "fp32 master weights" in deepspeed and "module by module" in deepspeed
    unknown = " ".join(not_expressed_parallel(config, "hf-fsdp"))
    assert "_no_split_modules" in unknown  # the blocks' class is not known without the trace
    assert "per-GPU batch" in " ".join(not_expressed_parallel(_fsdp(micro_batch=None), "deepspeed"))
    assert any(n.startswith("parallel: fsdp2-no-reshard over 2 GPUs") for n in not_expressed(config, "hf"))
    assert not_expressed_parallel(PlanConfig(micro_batch=4), "deepspeed") == []
    assert not_expressed_parallel(PlanConfig(), "hf-fsdp") == []


def test_a_planned_bert_exports_on_two_gpus() -> None:
    trace = load_trace(BERT32)
    summary = build_summary(trace)
    plan = doctor(trace, summary, Target(4 * GiB, gpus=2))["plan"]
    config = config_for_summary(trace, {**summary, "plan": plan})
    assert config is not None and config.gpus == 2 and config.parallel is not None
    classes = shard_classes(trace, config, plan["model"])
    doc = accelerate_config(config, classes)
    assert doc["num_processes"] == 2
    if config.parallel != "ddp":
        assert doc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"
    ds = json.loads(json.dumps(deepspeed_config(config)))
    assert ds["train_batch_size"] == 32  # the same effective batch
