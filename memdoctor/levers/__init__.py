"""Applying a ``memdoctor.yaml`` to an unmodified training script, at runtime (``memdoctor run``).

``memdoctor.levers.install.install(config)`` patches this process so that the script, when it runs,
trains with the plan: each part is an installer with an undo (``memdoctor/levers/*.py``), and the
model, its optimizer and its batches are found as the script creates and uses them
(``memdoctor.levers.targets``). How each part is applied, and its limits: docs/config.md, "How
memdoctor run applies each part". This ``__init__`` imports no torch, so ``memdoctor run``'s parent
process starts fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class FrameworkPatch:
    """What ``memdoctor.levers.frameworks.patch_frameworks(config)`` applied through a framework's own
    arguments (HF ``TrainingArguments``, Lightning ``Trainer``).

    ``handled`` names the config parts the framework path took over ("checkpoint", "precision",
    "accumulation", "padding", "data_loader", "optimizer", "attention"); the runtime installer leaves
    those alone, so nothing is applied twice. It may grow after ``patch_frameworks`` returns (a Trainer
    is built by the script later): the installer reads it when it installs each part, when the script
    builds the model's optimizer (the model parts), or at each use (DataLoader settings, padding).
    """

    lines: list[str] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)
    undo: Callable[[], None] = lambda: None


__all__ = ["FrameworkPatch"]
