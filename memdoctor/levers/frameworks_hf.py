"""The HF ``TrainingArguments`` / ``Trainer`` adapter of ``memdoctor run`` (``frameworks.py`` says why).

``TrainingArguments.__post_init__`` is patched, so every setting it derives follows the plan's batch
split, precision and DataLoader values; ``Trainer.__init__`` turns on HF's own gradient checkpointing
when the plan checkpoints exactly the layers that switch checkpoints.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from memdoctor.config.export import hf_training_arguments
from memdoctor.levers.frameworks_state import FrameworkState, framework_splits, micro_batch_note
from memdoctor.units import fit_name


def patch_training_arguments(state: FrameworkState, module: ModuleType) -> None:
    """The plan's values are set before ``__post_init__`` derives everything else from them."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(args: Any, *a: Any, **kw: Any) -> Any:
            if not args.__dict__.get("_memdoctor_applied"):
                args.__dict__["_memdoctor_applied"] = True
                state.guard("HF TrainingArguments", _apply_training_arguments, state, args, module)
            return original(args, *a, **kw)

        return __post_init__

    state.wrap(module.TrainingArguments, "__post_init__", make)


def patch_trainer(state: FrameworkState, module: ModuleType) -> None:
    """HF's own checkpointing switch is set once the Trainer knows its model."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(trainer: Any, *a: Any, **kw: Any) -> None:
            original(trainer, *a, **kw)
            if state.config.checkpoint:
                state.guard("HF Trainer: checkpoint", _hf_checkpointing, state, trainer)

        return __init__

    state.wrap(module.Trainer, "__init__", make)


def _apply_training_arguments(state: FrameworkState, args: Any, module: ModuleType) -> None:
    """Set the plan's values on the user's TrainingArguments before their own ``__post_init__``."""
    config, wanted = state.config, hf_training_arguments(state.config)
    if framework_splits(config):
        _hf_accumulation(state, args)
    if config.precision != "fp32":
        _hf_precision(state, args, module, wanted)
    _hf_data_loader(state, args, wanted)


def _hf_accumulation(state: FrameworkState, args: Any) -> None:
    n, batch, gas = (
        state.config.accumulation_steps,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
    )
    if batch % n:
        state.say(
            f"HF Trainer: accumulation not applied through TrainingArguments: per_device_train_batch_size="
            f"{batch} is not divisible by the plan's accumulation_steps={n} (left to the generic path)"
        )
        return
    args.per_device_train_batch_size, args.gradient_accumulation_steps = batch // n, gas * n
    note = micro_batch_note(state.config, batch)
    state.say(
        f"HF Trainer: per_device_train_batch_size={batch // n} (was {batch}), gradient_accumulation_steps="
        f"{gas * n} (was {gas}): the same {batch * gas} samples per optimizer step per device{note}"
    )
    state.handled.add("accumulation")


def _hf_precision(state: FrameworkState, args: Any, module: ModuleType, wanted: dict[str, Any]) -> None:
    key = "bf16" if "bf16" in wanted else "fp16"
    other = "fp16" if key == "bf16" else "bf16"
    if key == "bf16" and not _hf_bf16_ok(args, module):
        state.say(
            "HF Trainer: bf16 refused: TrainingArguments says this device has no bf16 "
            "(left to the generic path)"
        )
        return
    note = f" (the script set {other}=True; the plan's {key} is used instead)" if getattr(args, other) else ""
    setattr(args, other, False)
    setattr(args, key, True)
    scaler = " with the Trainer's own loss scaling" if key == "fp16" else ""
    state.say(f"HF Trainer: {key}=True{scaler}{note}")
    state.handled.add("precision")


def _hf_bf16_ok(args: Any, module: ModuleType) -> bool:
    """The check ``TrainingArguments`` itself makes (it raises otherwise); True where it cannot be read."""
    gpu_ok = getattr(module, "is_torch_bf16_gpu_available", None)
    xla_ok = getattr(module, "is_torch_xla_available", None)
    if gpu_ok is None or xla_ok is None:
        return True
    return bool(getattr(args, "use_cpu", False) or gpu_ok() or xla_ok())


def _hf_data_loader(state: FrameworkState, args: Any, wanted: dict[str, Any]) -> None:
    values = {k: v for k, v in wanted.items() if k.startswith("dataloader_")}
    workers = values.get("dataloader_num_workers", args.dataloader_num_workers)
    if "dataloader_prefetch_factor" in values and not workers:
        del values["dataloader_prefetch_factor"]  # TrainingArguments refuses it without workers
        state.say("HF Trainer: data_loader.prefetch_factor refused: it needs num_workers > 0")
    if not values:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    parts = []
    for key, value in values.items():
        before = getattr(args, key)
        own = f" (the script set {before!r})" if before != defaults.get(key) and before != value else ""
        setattr(args, key, value)
        parts.append(f"{key}={value!r}{own}")
    state.say("HF Trainer: " + ", ".join(parts))
    state.handled.add("data_loader")


def _hf_checkpointing(state: FrameworkState, trainer: Any) -> None:
    """Use HF's own switch when it checkpoints exactly the chosen modules; else the generic path."""
    args, model, wanted = trainer.args, trainer.model, set(state.config.checkpoint)
    built_later = getattr(trainer, "model_init", None) is not None  # train() builds the model again
    every = None if built_later else _hf_every_n_layers(model, wanted)
    own = bool(_hf_switch(args))
    if every is None:
        if own:
            _set_hf_switch(args, False)
        why = (
            "the Trainer builds its model in train() (model_init)"
            if built_later
            else f"the {len(wanted)} chosen modules are not a layer set HF's own switch checkpoints"
        )
        state.say(
            f"HF Trainer: {why}: the generic path checkpoints them"
            + (" (the script's gradient_checkpointing=True is turned off)" if own else "")
        )
        return
    kwargs = dict(_hf_switch(args, "_kwargs") or {})
    kwargs["use_reentrant"] = False
    if every > 1:
        kwargs["every_n_layers"] = every
    _set_hf_switch(args, True, kwargs)
    which = "every layer" if every == 1 else f"every {_ordinal(every)} layer"
    state.say(f"HF Trainer: gradient_checkpointing=True ({which}: the {len(wanted)} chosen modules)")
    state.handled.add("checkpoint")


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# transformers 5.2x renamed TrainingArguments' ``gradient_checkpointing[_kwargs]`` to
# ``activation_checkpointing[_kwargs]`` (the old names stay as deprecated mirrors, resolved in
# ``__post_init__``, which has run by the time the Trainer exists): set and read both, new name first.
_HF_SWITCHES = ("activation_checkpointing", "gradient_checkpointing")


def _hf_switch(args: Any, suffix: str = "") -> Any:
    for name in _HF_SWITCHES:
        value = getattr(args, name + suffix, None)
        if value is not None:
            return value
    return None


def _set_hf_switch(args: Any, on: bool, kwargs: dict[str, Any] | None = None) -> None:
    for name in _HF_SWITCHES:
        if hasattr(args, name):
            setattr(args, name, on)
        if kwargs is not None and hasattr(args, name + "_kwargs"):
            setattr(args, name + "_kwargs", kwargs)


def _hf_every_n_layers(model: Any, wanted: set[str]) -> int | None:
    """k such that HF's ``every_n_layers=k`` checkpoints exactly ``wanted``; None when no k does."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # an older transformers: its switch cannot be matched layer by layer
        return None
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    layers, others = [], False
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer):
            layers.append(fit_name(name))
        elif hasattr(module, "gradient_checkpointing") and not isinstance(module, PreTrainedModel):
            others = True  # an old-style module that checkpoints its own children: more than planned
    if others or not layers:
        return None
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    steps = len(layers) if enable and "every_n_layers" in inspect.signature(enable).parameters else 1
    for k in range(1, steps + 1):
        if {n for i, n in enumerate(layers) if i % k == 0} == wanted:
            return k
    return None
