"""The levers of a what-if: ``Config``, the profiled run with some levers changed (``Config()`` changes
nothing). The memory model (``memdoctor.plan.memory``) and the time model (``memdoctor.plan.timing``)
read it; the planner searches over it; ``as_dict`` is what ``summary.json``'s plan carries.

One vocabulary: every field has the name and the values of the same field of ``memdoctor.yaml``
(``memdoctor.config.PlanConfig``, docs/config.md), so a plan reaches the file, ``memdoctor run`` and
the exports without a translation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("as-is", "8bit", "offload")
# Padding policies a plan can apply: "as-is" (as profiled) or "trim" (each batch to its longest sequence:
# changes no data).
PADDING_POLICIES = ("as-is", "trim")
# Truncating sequences to that length percentile changes the data: the planner only offers it as an
# alternative, labelled, never as the plan (memdoctor.yaml cannot say it).
TRUNCATIONS = ("p90", "p99")
# How the step is spread over several processes (one per GPU), each an engine torch ships: None (one
# process, as profiled), "ddp" (DistributedDataParallel: every rank holds the whole model state),
# "fsdp2" (``fully_shard`` with ``reshard_after_forward=True``: parameters, gradients and optimizer state
# sharded, each block's parameters gathered for its forward and again for its backward) and
# "fsdp2-no-reshard" (``reshard_after_forward=False``: gathered once, kept from forward to backward).
# ``full_offload`` with an FSDP2 value is ``CPUOffloadPolicy`` on every rank.
PARALLEL = ("ddp", "fsdp2", "fsdp2-no-reshard")
# The allocator setting the planner models (PYTORCH_CUDA_ALLOC_CONF); None keeps the script's.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class Config:
    """A what-if: the levers applied on top of the profiled run (which is ``Config()``)."""

    checkpoint: tuple[str, ...] = ()  # module names, none nested in another
    accumulation_steps: int = 1  # micro-batches per step: the micro-batch is the measured batch / this
    precision: str = "fp32"  # one of PRECISIONS: "fp32" (as profiled), "bf16" or "fp16" autocast
    optimizer: str = "as-is"  # one of OPTIMIZERS: "8bit" (8-bit state), "offload" (state on the CPU)
    padding: str = "as-is"  # one of PADDING_POLICIES or TRUNCATIONS
    pad_to_multiple_of: int | None = None  # with a padding policy: round each batch's length up to this
    offload_parameters: tuple[str, ...] = ()  # modules whose parameters (and gradients) live on the CPU
    attention: str | None = None  # None (as profiled) or "sdpa" (memory-efficient attention, not eager)
    allocator: str | None = None  # None (as profiled) or EXPANDABLE_SEGMENTS
    # Parameters, gradients and optimizer state all on the CPU (FSDP2 fully_shard + CPUOffloadPolicy):
    # excludes ``optimizer: offload`` and ``offload_parameters``, which it contains.
    full_offload: bool = False
    gpus: int = 1  # processes, one GPU each (torch.distributed.run --nproc-per-node): the world size
    parallel: str | None = None  # None (one process) or one of PARALLEL; with gpus > 1
    # With an FSDP2 value: the modules wrapped with their own ``fully_shard`` (the repeated blocks, none
    # nested in another), before the root's; empty: the root's alone.
    shard_modules: tuple[str, ...] = ()

    def levers(self) -> list[str]:
        out = [f"checkpoint {len(self.checkpoint)} modules"] if self.checkpoint else []
        k = self.accumulation_steps
        if k > 1:
            out.append(f"micro-batch 1/{k} with {k}-step gradient accumulation")
        if self.precision != "fp32":
            out.append(f"{self.precision} autocast")
        if self.optimizer == "8bit":
            out.append("8-bit optimizer")
        elif self.optimizer == "offload":
            out.append("optimizer state offloaded to the CPU")
        return out + self._more_levers()

    def _more_levers(self) -> list[str]:
        out = []
        multiple = f", pad_to_multiple_of={self.pad_to_multiple_of}" if self.multiple() > 1 else ""
        if self.padding == "trim":
            out.append(f"pad each batch to its longest sequence{multiple}")
        elif self.padding != "as-is":
            out.append(f"truncate sequences to their {self.padding} length{multiple} (changes the data)")
        if self.offload_parameters:
            out.append(f"parameters of {', '.join(self.offload_parameters)} offloaded to the CPU")
        if self.attention == "sdpa":
            out.append("memory-efficient attention (SDPA) instead of eager")
        if self.allocator == EXPANDABLE_SEGMENTS:
            out.append("allocator expandable_segments")
        if self.full_offload:
            out.append("parameters, gradients and optimizer state offloaded to the CPU (FSDP2)")
        if self.parallel is not None:
            blocks = f", {len(self.shard_modules)} blocks sharded" if self.shard_modules else ""
            out.append(f"{self.parallel} over {self.gpus} GPUs{blocks}")
        return out

    def families(self) -> list[str]:
        """The lever families this config uses (the nine-grid's priority table orders them)."""
        found = {
            "checkpoint": bool(self.checkpoint),
            "accumulation": self.accumulation_steps > 1,
            "precision": self.precision != "fp32",
            "8bit": self.optimizer == "8bit",
            "offload": self.optimizer == "offload" or bool(self.offload_parameters) or self.full_offload,
            "padding": self.padding != "as-is",
            "attention": self.attention is not None,
            "allocator": self.allocator is not None,
            "parallel": self.parallel is not None,
        }
        return [k for k, used in found.items() if used]

    def changes_data(self) -> bool:
        return self.padding in TRUNCATIONS

    def multiple(self) -> int:
        """The length multiple a padding policy rounds up to (1: none)."""
        return self.pad_to_multiple_of or 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": list(self.checkpoint),
            "accumulation_steps": self.accumulation_steps,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "padding": self.padding,
            "pad_to_multiple_of": self.pad_to_multiple_of if self.multiple() > 1 else None,
            "offload_parameters": list(self.offload_parameters),
            "attention": self.attention,
            "allocator": self.allocator,
            "full_offload": self.full_offload,
            "gpus": self.gpus,
            "parallel": self.parallel,
            "shard_modules": list(self.shard_modules),
        }


# What memdoctor 0.1.0 wrote before the planner took memdoctor.yaml's vocabulary, in summary.json's plan
# (``config`` of the plan, its prediction and its alternatives) and in the benchmarks' results that copy
# it (benchmarks/results-*.json, tests/data/accuracy): the planner's own values for three levers. Read
# as today's.
LEGACY_VALUES: dict[str, dict[str, str | None]] = {
    "padding": {"longest": "trim"},
    "attention": {"as-is": None},
    "allocator": {"as-is": None, "expandable": EXPANDABLE_SEGMENTS},
}


def config_from_dict(d: dict[str, Any]) -> Config:
    """The ``Config`` of an ``as_dict`` mapping (summary.json's plan ``config``), old values included
    (``LEGACY_VALUES``); a missing key keeps the profiled run's setting."""
    values: dict[str, Any] = {k: _current(k, v) for k, v in d.items()}
    return Config(
        checkpoint=tuple(values.get("checkpoint") or ()),
        accumulation_steps=int(values.get("accumulation_steps") or 1),
        precision=str(values.get("precision") or "fp32"),
        optimizer=str(values.get("optimizer") or "as-is"),
        padding=str(values.get("padding") or "as-is"),
        pad_to_multiple_of=values.get("pad_to_multiple_of"),
        offload_parameters=tuple(values.get("offload_parameters") or ()),
        attention=values.get("attention"),
        allocator=values.get("allocator"),
        full_offload=bool(values.get("full_offload") or False),
        gpus=int(values.get("gpus") or 1),
        parallel=values.get("parallel"),
        shard_modules=tuple(values.get("shard_modules") or ()),
    )


def _current(key: str, value: Any) -> Any:
    return LEGACY_VALUES.get(key, {}).get(value, value) if isinstance(value, str) else value
