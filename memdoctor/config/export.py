"""The plan in other tools' own terms, for users who do not want memdoctor in their training code.

Each function returns plain data (a dict of keyword arguments, or a string); ``not_expressed(config,
tool)`` lists, one sentence each, the parts of the plan that tool's arguments cannot carry, so a caller
(or the report) can say so instead of silently dropping them. Where a tool's own switch is coarser than
the plan (HF ``gradient_checkpointing`` checkpoints every layer the model supports, not the chosen
modules), the note says that too.
"""

from __future__ import annotations

from typing import Any

from memdoctor.config import PlanConfig

TOOLS = ("hf", "lightning", "accelerate", "plain")


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
