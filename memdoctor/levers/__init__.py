"""Applying a memdoctor.yaml to a live, unmodified script (memdoctor run, memdoctor.apply), with undos.
Imports config, capture and patching; starts no process; this __init__ loads no torch (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Said (and recorded as a ``config_applied`` event) when checkpointed modules' saves are seen through
# (``levers.install``); here, so that the launch layer reads it without importing torch.
SEEN_THROUGH = "their saved tensors are measured in forward as if not checkpointed"


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


__all__ = ["SEEN_THROUGH", "FrameworkPatch"]
