"""The plan applied through the HF ``Trainer``'s and Lightning's own arguments (``memdoctor run``).

Why their own arguments: a Trainer that knows it accumulates keeps its optimizer-step count, its
learning-rate schedule and its loss normalisation right by itself, and its own ``bf16``/``fp16`` or
``precision`` drives autocast and loss scaling; memdoctor's generic patches would have to reproduce all
of that from outside. What is applied (``docs/config.md``, "How memdoctor run applies each part"):

- HF ``TrainingArguments`` (patched ``__post_init__``, so every derived setting follows):
  ``per_device_train_batch_size / n`` with ``gradient_accumulation_steps × n`` (n = the plan's
  ``accumulation_steps``), ``bf16``/``fp16``, ``dataloader_*``; HF ``Trainer`` (patched ``__init__``):
  ``gradient_checkpointing`` when the plan checkpoints exactly the layers HF's own switch checkpoints
  (every layer, or every k-th); otherwise checkpointing is left to the generic path.
- Lightning ``Trainer`` (patched ``__init__``, both ``lightning`` and ``pytorch_lightning``):
  ``accumulate_grad_batches × n`` and ``precision``; the training DataLoader is rebuilt around a batch
  sampler that splits each of the script's batches into n micro-batches (same samples, same order),
  or the accumulation is refused, by name, when the loader cannot be rebuilt faithfully.

When: ``patch_frameworks`` runs before the script, when no TrainingArguments or Trainer exists yet. The
classes are patched when the script imports the library (a ``sys.meta_path`` hook), so a script that
never imports transformers or Lightning pays nothing, and the library reads the environment the script
set up. Hence ``FrameworkPatch.lines`` and ``handled`` fill up *while the script runs*: a generic
installer must look at ``handled`` when it applies a part, not once at start. Each line is announced
(stderr) the moment it applies.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from memdoctor.config import PlanConfig
from memdoctor.config.export import hf_training_arguments, lightning_trainer_kwargs
from memdoctor.levers import FrameworkPatch

_MISSING = object()
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_FULL_PRECISION = (None, 32, "32", "32-true")


def patch_frameworks(config: PlanConfig, announce: Callable[[str], None] | None = None) -> FrameworkPatch:
    """Arm the framework patches for ``config``; ``undo`` of the result restores every patched class.

    ``announce`` receives each line when it applies (default: ``memdoctor: <line>`` on stderr).
    """
    state = _State(config, announce or _to_stderr)
    hooks: dict[str, Callable[[ModuleType], None]] = {}
    if importlib.util.find_spec("transformers") is not None:
        hooks["transformers.training_args"] = state.patch_training_arguments
        hooks["transformers.trainer"] = state.patch_hf_trainer
    for package in _LIGHTNING_PACKAGES:
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            hooks[f"{package}.trainer.trainer"] = state.patch_lightning_trainer
            hooks[f"{package}.trainer.connectors.data_connector"] = state.patch_data_connector
    finder = _PostImportHook({n: h for n, h in hooks.items() if n not in sys.modules})
    for name, hook in hooks.items():
        if name in sys.modules:  # already imported (memdoctor's own process, a test): patch now
            hook(sys.modules[name])
    if finder.hooks:
        sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        state.restore()

    return FrameworkPatch(lines=state.lines, handled=state.handled, undo=undo)


def _to_stderr(line: str) -> None:
    sys.stderr.write(f"memdoctor: {line}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------- imports


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``hooks[name](module)`` right after the module ``name`` has been executed.

    Python has no post-import hook of its own; this finder asks the other finders for the real spec and
    wraps only its loader's ``exec_module``. The module's ``__loader__``/``__spec__.loader`` are put back
    to the real loader right after, so nothing the script can see differs.
    """

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, self._run(fullname))
                return spec
        return None

    def _run(self, fullname: str) -> Callable[[ModuleType], None]:
        def run(module: ModuleType) -> None:
            hook = self.hooks.pop(fullname, None)
            if hook is not None:
                hook(module)

        return run


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.after = after

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)


# ----------------------------------------------------------------------------------------- state


class _State:
    """What is patched (for undo), what was applied (lines) and which plan parts are taken over."""

    def __init__(self, config: PlanConfig, announce: Callable[[str], None]) -> None:
        self.config = config
        self.announce = announce
        self.lines: list[str] = []
        self.handled: set[str] = set()
        self._patched: list[tuple[type, str, Any]] = []
        self.loader_hook = False  # Lightning's DataLoader preparation is patched (micro-batches possible)

    def say(self, line: str) -> None:
        """Record and announce ``line`` once (a script may build several TrainingArguments)."""
        if line not in self.lines:
            self.lines.append(line)
            self.announce(line)

    def guard(self, what: str, apply: Callable[..., Any], *args: Any) -> Any:
        """``apply(*args)``; an unexpected error is said, never raised into the script (its settings stay)."""
        try:
            return apply(*args)
        except Exception as exc:  # a framework version this code does not know: the script must still run
            self.say(
                f"{what}: not (fully) applied: {type(exc).__name__}: {exc}; the rest stays the script's own"
            )
            return None

    def wrap(self, cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``cls.name`` by ``make(original)``, remembering how to put it back."""
        original = getattr(cls, name)
        self._patched.append((cls, name, cls.__dict__.get(name, _MISSING)))
        setattr(cls, name, functools.wraps(original)(make(original)))

    def restore(self) -> None:
        while self._patched:
            cls, name, previous = self._patched.pop()
            if previous is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, previous)

    # ------------------------------------------------------------------ HF transformers

    def patch_training_arguments(self, module: ModuleType) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __post_init__(args: Any, *a: Any, **kw: Any) -> Any:
                if not args.__dict__.get("_memdoctor_applied"):
                    args.__dict__["_memdoctor_applied"] = True
                    self.guard("HF TrainingArguments", _apply_training_arguments, self, args, module)
                return original(args, *a, **kw)

            return __post_init__

        self.wrap(module.TrainingArguments, "__post_init__", make)

    def patch_hf_trainer(self, module: ModuleType) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(trainer: Any, *a: Any, **kw: Any) -> None:
                original(trainer, *a, **kw)
                if self.config.checkpoint:
                    self.guard("HF Trainer: checkpoint", _hf_checkpointing, self, trainer)

            return __init__

        self.wrap(module.Trainer, "__init__", make)

    # ------------------------------------------------------------------ Lightning

    def patch_lightning_trainer(self, module: ModuleType) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(trainer: Any, *a: Any, **kw: Any) -> None:
                kw, armed = self.guard("Lightning Trainer", _lightning_kwargs, self, kw) or (kw, None)
                original(trainer, *a, **kw)
                if armed is not None:  # (the script's accumulate_grad_batches, n) for the loader hook
                    trainer.__dict__["_memdoctor_accumulation"] = armed

            return __init__

        self.wrap(module.Trainer, "__init__", make)

    def patch_data_connector(self, module: ModuleType) -> None:
        connector = getattr(module, "_DataConnector", None)
        if connector is None or not hasattr(connector, "_prepare_dataloader"):
            return  # another Lightning: _lightning_accumulation refuses accumulation by name
        self.loader_hook = True

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def _prepare_dataloader(conn: Any, dataloader: Any, shuffle: bool, mode: Any) -> Any:
                prepared = original(conn, dataloader, shuffle, mode)
                if getattr(mode, "value", mode) != "train":
                    return prepared
                rebatched = self.guard(
                    "Lightning DataLoader", _lightning_rebatch, self, conn.trainer, prepared
                )
                return prepared if rebatched is None else rebatched

            return _prepare_dataloader

        self.wrap(connector, "_prepare_dataloader", make)


# ----------------------------------------------------------------------------------------- HF


def _apply_training_arguments(state: _State, args: Any, module: ModuleType) -> None:
    """Set the plan's values on the user's TrainingArguments before their own ``__post_init__``."""
    config, wanted = state.config, hf_training_arguments(state.config)
    if config.accumulation_steps > 1:
        _hf_accumulation(state, args)
    if config.precision != "fp32":
        _hf_precision(state, args, module, wanted)
    _hf_data_loader(state, args, wanted)


def _hf_accumulation(state: _State, args: Any) -> None:
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
    note = _micro_batch_note(state.config, batch)
    state.say(
        f"HF Trainer: per_device_train_batch_size={batch // n} (was {batch}), gradient_accumulation_steps="
        f"{gas * n} (was {gas}): the same {batch * gas} samples per optimizer step per device{note}"
    )
    state.handled.add("accumulation")


def _micro_batch_note(config: PlanConfig, batch: int) -> str:
    micro = config.micro_batch
    if micro is None or micro * config.accumulation_steps == batch:
        return ""
    return (
        f"; the config's micro_batch={micro} was planned for batch size {micro * config.accumulation_steps}, "
        f"the script's is {batch}"
    )


def _hf_precision(state: _State, args: Any, module: ModuleType, wanted: dict[str, Any]) -> None:
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


def _hf_data_loader(state: _State, args: Any, wanted: dict[str, Any]) -> None:
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


def _hf_checkpointing(state: _State, trainer: Any) -> None:
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
            layers.append(name)
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


# ----------------------------------------------------------------------------------------- Lightning


def _lightning_kwargs(state: _State, kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The user's ``Trainer`` kwargs with the plan's accumulation and precision (+ what to split by)."""
    config, out, armed = state.config, dict(kwargs), None
    if config.accumulation_steps > 1:
        armed = _lightning_accumulation(state, out)
    if config.precision != "fp32":
        wanted = lightning_trainer_kwargs(config)["precision"]
        own = out.get("precision")
        note = (
            ""
            if own in _FULL_PRECISION or own == wanted
            else f" (the script set {own!r}; the plan's is used)"
        )
        out["precision"] = wanted
        state.say(f"Lightning: precision={wanted!r}{note}")
        state.handled.add("precision")
    return out, armed


def _lightning_accumulation(state: _State, kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """Multiply ``accumulate_grad_batches`` by n, or refuse by name; the part is Lightning's either way."""
    n, own = state.config.accumulation_steps, int(kwargs.get("accumulate_grad_batches", 1))
    state.handled.add("accumulation")
    if not state.loader_hook:
        state.say("Lightning: accumulation refused: this Lightning has no DataLoader hook memdoctor knows")
        return None
    callbacks = kwargs.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    if any(type(c).__name__ == "GradientAccumulationScheduler" for c in callbacks):
        state.say("Lightning: accumulation refused: the script schedules accumulation itself")
        return None
    kwargs["accumulate_grad_batches"] = own * n
    state.say(
        f"Lightning: accumulate_grad_batches={own * n} (was {own}); each training batch is split into {n} "
        "micro-batches when the training DataLoader is built"
    )
    return own, n


def _lightning_rebatch(state: _State, trainer: Any, loader: Any) -> Any:
    """The training loader with each batch split into n micro-batches, or refused (accumulation undone)."""
    armed = trainer.__dict__.get("_memdoctor_accumulation")
    if armed is None or trainer.accumulate_grad_batches != armed[0] * armed[1]:
        return loader  # no plan for this Trainer, or the accumulation was already refused
    own, n = armed
    why, rebuilt = _cannot_rebatch(loader, n), None
    if why is None:
        try:
            rebuilt = _rebuild(loader, MicroBatchSampler(loader.batch_sampler, n))
        except Exception as exc:  # an argument this torch's DataLoader does not take back
            why = f"the training DataLoader could not be rebuilt ({type(exc).__name__}: {exc})"
    if rebuilt is None:  # the script's batches with the script's accumulation: its effective batch
        trainer.accumulate_grad_batches = own
        state.say(f"Lightning: accumulation refused: {why}; accumulate_grad_batches is back to {own}")
        return loader
    state.say(
        f"Lightning: training DataLoader batch size {loader.batch_size} -> {n} micro-batches of "
        f"{loader.batch_size // n}{_micro_batch_note(state.config, loader.batch_size)}"
    )
    return rebuilt


def _cannot_rebatch(loader: Any, n: int) -> str | None:
    from torch.utils.data import BatchSampler, DataLoader

    if type(loader) is not DataLoader:
        return (
            f"the training loader is a {type(loader).__name__}, not a plain DataLoader memdoctor can rebuild"
        )
    if type(loader.batch_sampler) is not BatchSampler:
        return "the training DataLoader has its own batch sampler (or no batching) memdoctor cannot split"
    size = loader.batch_sampler.batch_size
    if size % n:
        return f"its batch size {size} is not divisible by the plan's accumulation_steps={n}"
    return None


def _rebuild(loader: Any, batch_sampler: Any) -> Any:
    """The same DataLoader (dataset, workers, collate, pinning, ...) with another batch sampler."""
    from torch.utils.data import DataLoader

    skip = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
    params = inspect.signature(DataLoader.__init__).parameters
    kwargs = {p: getattr(loader, p) for p in params if p not in skip and hasattr(loader, p)}
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


class MicroBatchSampler:
    """Each batch of ``batches`` (a ``BatchSampler``) as ``n`` consecutive near-equal micro-batches.

    The samples and their order are the script's own; ``n`` micro-batches make one of its batches, so
    ``accumulate_grad_batches × n`` steps the optimizer on exactly the script's batches (a last, partial
    batch smaller than ``n`` samples gives fewer micro-batches; Lightning steps at the epoch's end).
    """

    def __init__(self, batches: Any, n: int) -> None:
        self.batches = batches
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            indices = list(batch)
            size, extra = divmod(len(indices), self.n)
            start = 0
            for i in range(min(self.n, len(indices))):
                stop = start + size + (1 if i < extra else 0)
                yield indices[start:stop]
                start = stop

    def __len__(self) -> int:
        batches = self.batches
        full, rest = divmod(len(batches.sampler), batches.batch_size)
        return full * self.n + (0 if batches.drop_last or not rest else min(self.n, rest))
