"""What the framework path has done so far: its patches (for undo), its lines and the parts it took over.

Shared by the HF (``frameworks_hf``) and Lightning (``frameworks_lightning``) adapters, which fill it
while the script runs; ``frameworks.patch_frameworks`` hands its ``lines`` and ``handled`` out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memdoctor import patching
from memdoctor.config import PlanConfig


class FrameworkState:
    """What is patched (for undo), what was applied (lines) and which plan parts are taken over."""

    def __init__(self, config: PlanConfig, announce: Callable[[str], None]) -> None:
        self.config = config
        self.announce = announce
        self.lines: list[str] = []
        self.handled: set[str] = set()
        self._undos: list[patching.Undo] = []
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
        self._undos.append(patching.wrap_attr(cls, name, make))

    def restore(self) -> None:
        """Undo every class patch, newest first (one someone patched over stays theirs)."""
        while self._undos:
            self._undos.pop()()


def framework_splits(config: PlanConfig) -> bool:
    """Whether the framework's own accumulation switch takes the plan's micro-batches: not when the
    script's own arguments do (``accumulation_split: arguments``), which already set the framework's
    batch and accumulation. Both at once split twice: GPT-2's Trainer, re-profiled through
    ``--batch-size 8 --grad-accum 2`` on the H200, ran at per-device batch 4 x 4 while the plan scaled
    its activations x2 (its plans under-predicted, then ran out of memory)."""
    return config.accumulation_steps > 1 and config.accumulation_split != "arguments"


def micro_batch_note(config: PlanConfig, batch: int) -> str:
    """Why the config's micro_batch differs from what the script's batch size gives, or ""."""
    micro = config.micro_batch
    if micro is None or micro * config.accumulation_steps == batch:
        return ""
    return (
        f"; the config's micro_batch={micro} was planned for batch size {micro * config.accumulation_steps}, "
        f"the script's is {batch}"
    )
