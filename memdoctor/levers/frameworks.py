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

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from memdoctor.config import PlanConfig
from memdoctor.levers import FrameworkPatch, frameworks_hf, frameworks_lightning
from memdoctor.levers.frameworks_lightning import MicroBatchSampler
from memdoctor.levers.frameworks_state import FrameworkState

__all__ = ["MicroBatchSampler", "patch_frameworks"]
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def patch_frameworks(config: PlanConfig, announce: Callable[[str], None] | None = None) -> FrameworkPatch:
    """Arm the framework patches for ``config``; ``undo`` of the result restores every patched class.

    ``announce`` receives each line when it applies (default: ``memdoctor: <line>`` on stderr).
    """
    state = FrameworkState(config, announce or _to_stderr)
    hooks = _hooks(state)
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


def _hooks(state: FrameworkState) -> dict[str, Callable[[ModuleType], None]]:
    """Module name -> the patch to run on it once imported, for the frameworks installed here."""
    hooks: dict[str, Callable[[ModuleType], None]] = {}
    if importlib.util.find_spec("transformers") is not None:
        hooks["transformers.training_args"] = lambda m: frameworks_hf.patch_training_arguments(state, m)
        hooks["transformers.trainer"] = lambda m: frameworks_hf.patch_trainer(state, m)
    for package in _LIGHTNING_PACKAGES:
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            hooks[f"{package}.trainer.trainer"] = lambda m: frameworks_lightning.patch_trainer(state, m)
            hooks[f"{package}.trainer.connectors.data_connector"] = lambda m: (
                frameworks_lightning.patch_data_connector(state, m)
            )
    return hooks


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
