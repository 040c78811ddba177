"""Runtime application of a memdoctor plan (``memdoctor run``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class FrameworkPatch:
    """What ``memdoctor.runtime.frameworks.patch_frameworks`` applied through a framework's own arguments."""

    # one human line per applied part, e.g. "HF Trainer: gradient_accumulation_steps=4 ..."
    lines: list[str]
    # config parts taken over: subset of {"checkpoint", "precision", "accumulation", "data_loader"}
    handled: set[str]
    # restores everything patched
    undo: Callable[[], None]
