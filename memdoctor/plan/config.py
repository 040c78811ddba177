"""The levers of a what-if: ``Config``, the profiled run with some levers changed (``Config()`` changes
nothing). The memory model (``memdoctor.plan.memory``) and the time model (``memdoctor.plan.timing``)
read it; the planner searches over it; ``as_dict`` is what ``summary.json``'s plan carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("as-is", "8bit", "offload")
# Padding policies: "as-is" (as profiled), "longest" (trim each batch to its longest sequence: changes
# no data), "p90"/"p99" (truncate sequences to that length percentile: changes the data, so the planner
# only offers it as an alternative, labelled).
PADDINGS = ("as-is", "longest", "p90", "p99")


@dataclass(frozen=True)
class Config:
    """A what-if: the levers applied on top of the profiled run (which is ``Config()``)."""

    checkpoint: tuple[str, ...] = ()  # module names, none nested in another
    accumulation: int = 1  # micro-batches per step: the micro-batch is the measured batch / accumulation
    precision: str = "fp32"  # "fp32" (as profiled), "bf16" or "fp16" autocast
    optimizer: str = "as-is"  # "as-is", "8bit" (8-bit optimizer state), "offload" (state on the CPU)
    padding: str = "as-is"  # one of PADDINGS
    pad_multiple: int = 1  # pad_to_multiple_of with a padding policy
    offload: tuple[str, ...] = ()  # modules whose parameters (and gradients) live on the CPU
    attention: str = "as-is"  # "as-is" or "sdpa" (memory-efficient attention instead of eager)
    allocator: str = "as-is"  # "as-is" or "expandable" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)

    def levers(self) -> list[str]:
        out = [f"checkpoint {len(self.checkpoint)} modules"] if self.checkpoint else []
        if self.accumulation > 1:
            out.append(
                f"micro-batch 1/{self.accumulation} with {self.accumulation}-step gradient accumulation"
            )
        if self.precision != "fp32":
            out.append(f"{self.precision} autocast")
        if self.optimizer == "8bit":
            out.append("8-bit optimizer")
        elif self.optimizer == "offload":
            out.append("optimizer state offloaded to the CPU")
        return out + self._more_levers()

    def _more_levers(self) -> list[str]:
        out = []
        multiple = f", pad_to_multiple_of={self.pad_multiple}" if self.pad_multiple > 1 else ""
        if self.padding == "longest":
            out.append(f"pad each batch to its longest sequence{multiple}")
        elif self.padding != "as-is":
            out.append(f"truncate sequences to their {self.padding} length{multiple} (changes the data)")
        if self.offload:
            out.append(f"parameters of {', '.join(self.offload)} offloaded to the CPU")
        if self.attention == "sdpa":
            out.append("memory-efficient attention (SDPA) instead of eager")
        if self.allocator == "expandable":
            out.append("allocator expandable_segments")
        return out

    def families(self) -> list[str]:
        """The lever families this config uses (the nine-grid's priority table orders them)."""
        found = {
            "checkpoint": bool(self.checkpoint),
            "accumulation": self.accumulation > 1,
            "precision": self.precision != "fp32",
            "8bit": self.optimizer == "8bit",
            "offload": self.optimizer == "offload" or bool(self.offload),
            "padding": self.padding != "as-is",
            "attention": self.attention != "as-is",
            "allocator": self.allocator != "as-is",
        }
        return [k for k, used in found.items() if used]

    def changes_data(self) -> bool:
        return self.padding not in ("as-is", "longest")

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": list(self.checkpoint),
            "accumulation_steps": self.accumulation,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "padding": self.padding,
            "pad_to_multiple_of": self.pad_multiple if self.pad_multiple > 1 else None,
            "offload_parameters": list(self.offload),
            "attention": self.attention,
            "allocator": self.allocator,
        }
