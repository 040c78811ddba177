"""The plan in other tools' own terms, for users who do not want memdoctor in their training code.

Each function returns plain data (a dict of keyword arguments, or a string); ``not_expressed(config,
tool)`` lists, one sentence each, the parts of the plan that tool's arguments cannot carry, so a caller
(or the report) can say so instead of silently dropping them. Where a tool's own switch is coarser than
the plan (HF ``gradient_checkpointing`` checkpoints every layer the model supports, not the chosen
modules), the note says that too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from memdoctor.config import PlanConfig

TOOLS = ("hf", "lightning", "accelerate", "plain")
# The several-GPU exports (``gpus``, ``parallel``, ``full_offload``), each a whole configuration of the
# tool's own engine: accelerate's config file (``accelerate launch --config_file``), the HF Trainer's
# ``TrainingArguments`` FSDP arguments, and a DeepSpeed ZeRO JSON (``not_expressed_parallel``).
PARALLEL_TOOLS = ("accelerate-config", "hf-fsdp", "deepspeed")
# ZeRO stage per engine: DDP replicates everything (0); FSDP2 shards parameters, gradients and
# optimizer state (3); FSDP2 without resharding after forward is nearest ZeRO-2 (gradients and
# optimizer state sharded, parameters whole: what differs is in ``not_expressed_parallel``).
ZERO_STAGES = {None: 0, "ddp": 0, "fsdp2": 3, "fsdp2-no-reshard": 2}


def hf_training_arguments(config: PlanConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` (the plan's numerics and batching)."""
    kw: dict[str, Any] = {"gradient_accumulation_steps": config.accumulation_steps}
    if config.micro_batch is not None:
        kw["per_device_train_batch_size"] = config.micro_batch
    if config.precision == "bf16":
        kw["bf16"] = True
    elif config.precision == "fp16":
        kw["fp16"] = True
    if config.checkpoint:
        kw["gradient_checkpointing"] = True
        kw["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if config.optimizer == "8bit":
        kw["optim"] = "adamw_bnb_8bit"
    dl = config.data_loader
    if dl.num_workers is not None:
        kw["dataloader_num_workers"] = dl.num_workers
    if dl.pin_memory is not None:
        kw["dataloader_pin_memory"] = dl.pin_memory
    if dl.persistent_workers is not None:
        kw["dataloader_persistent_workers"] = dl.persistent_workers
    if dl.prefetch_factor is not None:
        kw["dataloader_prefetch_factor"] = dl.prefetch_factor
    return kw


def lightning_trainer_kwargs(config: PlanConfig) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer``."""
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[config.precision]
    return {"accumulate_grad_batches": config.accumulation_steps, "precision": precision}


def accelerate_kwargs(config: PlanConfig) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` (the same keys as its config file's)."""
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[config.precision]
    return {"mixed_precision": mixed, "gradient_accumulation_steps": config.accumulation_steps}


def not_expressed(config: PlanConfig, tool: str) -> list[str]:
    """The plan's parts ``tool`` ("hf", "lightning", "accelerate", "plain") cannot carry, with a way out."""
    out: list[str] = []
    if config.checkpoint and tool == "hf":
        out.append(
            "checkpoint: gradient_checkpointing=True checkpoints every layer the model supports, "
            f"not only the {len(config.checkpoint)} chosen modules (memdoctor.apply checkpoints exactly them)"
        )
    elif config.checkpoint and tool in ("lightning", "accelerate"):
        out.append(
            "checkpoint: no Trainer/Accelerator argument; call memdoctor.apply(config, model) on the "
            "model before training (it wraps exactly the chosen modules)"
        )
    if config.optimizer == "8bit" and tool != "hf":
        out.append("optimizer: 8bit: build bitsandbytes.optim.AdamW8bit with your optimizer's settings")
    # memdoctor.apply (the plain-loop snippet) and memdoctor run offload through torch
    # (memdoctor.levers.offload); a Trainer's or Accelerator's own arguments cannot: DeepSpeed can.
    if config.optimizer == "offload" and tool != "plain":
        out.append(
            "optimizer: offload: no argument for it; DeepSpeed ZeRO-Offload (offload_optimizer_device: cpu), "
            "or memdoctor run / memdoctor.apply (the state on the CPU through torch)"
        )
    if config.padding != "as-is":
        multiple = f" (pad_to_multiple_of={config.pad_to_multiple_of})" if config.pad_to_multiple_of else ""
        out.append(f"padding: {config.padding}: trim padding in the collate function{multiple}")
    if config.offload_parameters and tool != "plain":
        out.append(
            "offload_parameters: no argument for it (accelerate's device_map / cpu_offload are for "
            "inference); DeepSpeed ZeRO-3 offload_param, or memdoctor run / memdoctor.apply"
        )
    if config.full_offload and tool != "plain":
        out.append(
            "full_offload: no single-process argument for it; memdoctor run / memdoctor.apply (FSDP2 "
            "fully_shard with CPUOffloadPolicy), or DeepSpeed ZeRO-3 with offload_param and "
            "offload_optimizer on cpu"
        )
    if config.parallel is not None:
        out.append(
            f"parallel: {config.parallel} over {config.gpus} GPUs: launch with torchrun --nproc-per-node "
            f"{config.gpus} (or memdoctor run --nproc-per-node {config.gpus}); the engine's own "
            "configuration is accelerate_config / hf_parallel_arguments / deepspeed_config"
        )
    if config.attention is not None:
        out.append(f"attention: pass attn_implementation={config.attention!r} to from_pretrained")
    if config.allocator is not None:
        out.append(f"allocator: set PYTORCH_CUDA_ALLOC_CONF={config.allocator} in the environment")
    if config.micro_batch is not None and tool != "hf":
        out.append(f"micro_batch: build the DataLoader with batch_size={config.micro_batch}")
    if tool != "hf" and any(v is not None for v in vars(config.data_loader).values()):
        out.append("data_loader: build the DataLoader with the config's data_loader settings")
    return out


def _offload_comment(config: PlanConfig) -> list[str]:
    parts = []
    if config.offload_parameters:
        parts.append(f"the parameters of {len(config.offload_parameters)} module(s)")
    if config.optimizer == "offload":
        parts.append("the optimizer's state (its step runs on the CPU)")
    if config.full_offload:
        parts.append("every parameter and gradient and the optimizer state (FSDP2, before its first step)")
    return [f"# offload: {' and '.join(parts)} kept in CPU memory"] if parts else []


def plain_loop_snippet(config: PlanConfig, config_path: str = "memdoctor.yaml") -> str:
    """An annotated Python snippet applying the plan in a plain training loop with ``memdoctor.apply``."""
    k = config.accumulation_steps
    lines = [
        "import memdoctor",
        "",
        f"config = memdoctor.load_config({config_path!r})",
        "# checkpointing: wraps the forward of exactly "
        + (f"{len(config.checkpoint)} chosen modules" if config.checkpoint else "no module (none chosen)"),
        *_offload_comment(config),
        "applied = memdoctor.apply(config, model, optimizer)",
        "for batch in loader:",
        f"    # {k} micro-batch(es) per optimizer step; weight = the micro-batch's share of the batch",
        "    for micro, weight in applied.micro_batches(batch):",
        f"        with applied.autocast():  # {config.precision}"
        + (" autocast" if config.precision != "fp32" else ": no autocast"),
        "            loss = compute_loss(model, micro) * weight",
        "        applied.backward(loss)"
        + ("  # scaled by the fp16 GradScaler" if config.precision == "fp16" else ""),
        "    applied.step()  # optimizer.step() (+ GradScaler update), then zero_grad()",
        "applied.remove()  # the model's modules are as they were",
    ]
    notes = not_expressed(config, "plain")
    if notes:
        lines += ["", "# Not applied by this snippet (do these yourself):"]
        lines += [f"#   {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- several GPUs


def accelerate_config(config: PlanConfig, layer_classes: Sequence[str] = ()) -> dict[str, Any]:
    """An accelerate config file's content (``accelerate launch --config_file FILE``): DDP as
    ``MULTI_GPU``, FSDP2 (``fsdp_version: 2``) with ``reshard_after_forward``, CPU offload and the
    shard modules' classes (``layer_classes``: ``from_plan.shard_classes``) as the layers to wrap."""
    kind = {None: "NO", "ddp": "MULTI_GPU", "fsdp2": "FSDP", "fsdp2-no-reshard": "FSDP"}[config.parallel]
    if config.full_offload:
        kind = "FSDP"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_processes": config.gpus,
        "num_machines": 1,
        "machine_rank": 0,
        "mixed_precision": {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[config.precision],
        "use_cpu": False,
        "debug": False,
    }
    if kind == "FSDP":
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": config.parallel != "fsdp2-no-reshard",
            "fsdp_offload_params": config.full_offload,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            **({"fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes)} if layer_classes else {}),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
    return out


def hf_parallel_arguments(config: PlanConfig, layer_classes: Sequence[str] = ()) -> dict[str, Any]:
    """``transformers.TrainingArguments`` kwargs for the plan's engine, on top of
    ``hf_training_arguments``: FSDP2 (``fsdp=True`` and ``fsdp_config``: version 2,
    ``reshard_after_forward``, ``cpu_offload``, the layers to wrap); nothing for DDP (the Trainer uses
    it by itself under torchrun); the per-device batch is the plan's per-rank micro-batch."""
    kw: dict[str, Any] = {}
    if config.parallel in ("fsdp2", "fsdp2-no-reshard") or config.full_offload:
        fsdp: dict[str, Any] = {
            "version": 2,
            "reshard_after_forward": config.parallel != "fsdp2-no-reshard",
            "cpu_offload": config.full_offload,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        }
        if layer_classes:
            fsdp["transformer_layer_cls_to_wrap"] = list(layer_classes)
        kw.update(fsdp=True, fsdp_config=fsdp)
    return kw


def deepspeed_config(config: PlanConfig) -> dict[str, Any]:
    """A DeepSpeed config (``deepspeed.initialize(config=...)``, the HF Trainer's ``deepspeed=``): the
    ZeRO stage of the engine (``ZERO_STAGES``; full offload: stage 3 with parameters and optimizer on
    the CPU; optimizer offload: its stage with the optimizer on the CPU), the batch and the 16-bit mode."""
    stage = 3 if config.full_offload else ZERO_STAGES[config.parallel]
    if config.optimizer == "offload":
        stage = max(stage, 2)  # ZeRO-Offload needs the optimizer state partitioned (stage 1 or more)
    zero: dict[str, Any] = {"stage": stage}
    cpu = {"device": "cpu", "pin_memory": True}
    if config.full_offload:
        zero["offload_param"] = dict(cpu)
    if config.full_offload or config.optimizer == "offload":
        zero["offload_optimizer"] = dict(cpu)
    out: dict[str, Any] = {
        "gradient_accumulation_steps": config.accumulation_steps,
        "zero_optimization": zero,
    }
    if config.micro_batch is not None:
        out["train_micro_batch_size_per_gpu"] = config.micro_batch
        out["train_batch_size"] = config.micro_batch * config.accumulation_steps * config.gpus
    if config.precision == "bf16":
        out["bf16"] = {"enabled": True}
    elif config.precision == "fp16":
        scaler = config.grad_scaler
        fp16: dict[str, Any] = {"enabled": True}
        if scaler is not None:
            fp16["initial_scale_power"] = max(0, round(math.log2(scaler.init_scale)))
            fp16["loss_scale_window"] = scaler.growth_interval
        out["fp16"] = fp16
    return out


_CHECKPOINT_NOTES = {
    "accelerate-config": "checkpoint: fsdp_activation_checkpointing checkpoints every wrapped layer, not "
    "the chosen modules; memdoctor.apply(config, model) checkpoints exactly them",
    "hf-fsdp": "checkpoint: fsdp_config's activation_checkpointing checkpoints every wrapped layer, not the "
    "chosen modules; memdoctor.apply(config, model) checkpoints exactly them",
    "deepspeed": "checkpoint: DeepSpeed's activation_checkpointing section drives only the "
    "deepspeed.checkpointing calls in the model's code; memdoctor.apply checkpoints the chosen modules",
}


def not_expressed_parallel(config: PlanConfig, tool: str, layer_classes: Sequence[str] = ()) -> list[str]:
    """The plan's parts the several-GPU export ``tool`` (``PARALLEL_TOOLS``) cannot carry, one sentence
    each, with the way out."""
    out = _engine_notes(config, tool, layer_classes)
    if config.checkpoint:
        out.append(_CHECKPOINT_NOTES[tool])
    if config.precision != "fp32" and tool == "deepspeed":
        out.append(
            f"precision: {config.precision}: DeepSpeed's {config.precision} mode trains 16-bit weights with "
            "fp32 master weights in the optimizer, not torch.autocast over fp32 weights: its memory and "
            "numerics differ from the plan's"
        )
    elif config.precision != "fp32" and config.parallel != "ddp" and (config.parallel or config.full_offload):
        out.append(
            f"precision: {config.precision}: under FSDP accelerate's mixed precision may gather the "
            "parameters in 16 bits (FSDP2's MixedPrecisionPolicy) instead of autocast over fp32 weights: "
            "less memory than planned, and other numerics"
        )
    if config.optimizer == "8bit" and tool == "deepspeed":
        out.append("optimizer: 8bit: no DeepSpeed optimizer for it; build bitsandbytes.optim.AdamW8bit")
    if config.offload_parameters:
        out.append(
            "offload_parameters: the engines offload every parameter or none (FSDP2 CPUOffloadPolicy, ZeRO-3 "
            "offload_param), not chosen modules; memdoctor run / memdoctor.apply"
        )
    if config.micro_batch is None and (tool == "deepspeed" or config.gpus > 1):
        out.append(
            "micro_batch: not measured: the per-GPU batch is your batch / (gpus x accumulation_steps), "
            f"here / {config.gpus * config.accumulation_steps}"
        )
    return out


def _engine_notes(config: PlanConfig, tool: str, layer_classes: Sequence[str]) -> list[str]:
    """What the engine's own switches say differently from the plan."""
    out: list[str] = []
    if config.gpus > 1:
        out.append(
            f"gpus: {config.gpus}: the export configures the engine; launch {config.gpus} processes "
            + {
                "accelerate-config": "with accelerate launch --config_file FILE",
                "hf-fsdp": "with torchrun --nproc-per-node (or accelerate launch)",
                "deepspeed": "with the deepspeed launcher or torchrun --nproc-per-node",
            }[tool]
        )
    fsdp = config.parallel in ("fsdp2", "fsdp2-no-reshard") or config.full_offload
    if fsdp and tool != "deepspeed" and config.shard_modules and not layer_classes:
        out.append(
            "shard_modules: their classes are not known here: the wrap policy falls back to the model's "
            "_no_split_modules (HF models), else wraps nothing but the root"
        )
    elif fsdp and tool != "deepspeed" and config.shard_modules:
        out.append(
            f"shard_modules: wraps every module of class {', '.join(layer_classes)}, the plan's "
            f"{len(config.shard_modules)} blocks where they are all the modules of that class"
        )
    if tool == "deepspeed" and config.parallel == "fsdp2-no-reshard":
        out.append(
            "parallel: fsdp2-no-reshard as ZeRO-2: ZeRO-2 keeps every parameter whole on every rank, also "
            "between steps, where FSDP2 without resharding shards them between steps and gathers them once "
            "per step; the same peak in backward, (N-1)/N of the parameters more at rest (ZeRO-3 has no "
            "switch to gather once and keep them to the backward)"
        )
    if tool == "deepspeed" and fsdp and config.shard_modules:
        out.append(
            "shard_modules: ZeRO-3 partitions every parameter and gathers them module by module as they run, "
            "not by the plan's blocks"
        )
    return out
