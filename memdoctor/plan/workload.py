"""What one trace measured, split by the levers that act on it (``Workload``): parameters, gradients,
optimizer state, activations (what the modules saved for backward), temporaries (the peak ledger's
allocations by code site) and a fixed rest (workspaces, allocator slack); with the modules that could
be checkpointed (``Candidate``) or offloaded (``ParamHolder``). ``memdoctor.plan.measure`` reads it from
a trace, ``memdoctor.plan.reprofiled`` from a re-profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from memdoctor.plan.padding import Padding
from memdoctor.plan.splits import AS_BEFORE, Split


@dataclass(frozen=True)
class Candidate:
    """A module that could be checkpointed: what it frees and what recomputing it costs."""

    name: str
    model: int
    index: int
    depth: int
    free_bytes: int
    forward_ms: float
    ancestors: frozenset[tuple[int, int]]

    @property
    def key(self) -> tuple[int, int]:
        return (self.model, self.index)

    @property
    def bytes_per_ms(self) -> float:
        return self.free_bytes / max(self.forward_ms, 1e-3)


@dataclass(frozen=True)
class ParamHolder:
    """A module whose parameters could live on the CPU: what that frees and what moving them costs."""

    name: str
    param_bytes: int
    grad_bytes: int
    forward_ms: float | None


@dataclass
class Workload:
    """What one trace measured, split by the levers that act on it."""

    peak_bytes: int
    reserved_ratio: float  # max reserved / max allocated at the peak step (allocator slack), >= 1
    parameters: int
    gradients_at_peak: int
    gradients: int  # all gradients allocated (measured before the optimizer step)
    optimizer_state: int
    activations: int  # at the peak
    temporaries: int  # the peak ledger's temporaries: scale with the micro-batch
    fixed: int  # the rest of the peak: workspaces, allocator slack, unattributed
    # Share of the saved activations that adding autocast would store in 16 bits: those of every module
    # still in fp32 but the types autocast keeps in fp32 (``memdoctor.plan.measure.AMP_FACTORS``; measured
    # by the precision collector: none where the script autocasts already).
    amp_share: float
    matmul_param_bytes: int
    step_ms: float | None
    fwd_bwd_ms: float | None
    compute_class: str | None
    batch_size: int | None
    complete: bool  # the peak step finished (not cut short by an OOM)
    candidates: list[Candidate]
    offload_bytes_per_s: float | None  # measured pinned host<->device rate
    bf16_native: bool | None  # of the profiled device
    precision_verdict: str | None
    notes: list[str] = field(default_factory=list)  # measured gaps and assumptions of the calibration
    padding: Padding | None = None  # None: no token batch with real lengths was measured
    padding_unavailable: str | None = None  # why the padding levers are unavailable
    attention_temporaries: int = 0  # peak-ledger temporaries allocated in eager attention code
    param_holders: list[ParamHolder] = field(default_factory=list)  # offload candidates, best first
    device_name: str | None = None  # the profiled GPU (for its datasheet peaks)
    peak_fraction: float | None = None  # measured FLOP/s over the profiled GPU's fp32 datasheet peak
    scale_window_log2: tuple[int, int] | None = None  # fp16 loss scales that fit the measured gradients
    suggested_scale_log2: int | None = None
    # The script as it is ran out of memory under this budget (this workload then comes from a re-profile
    # at a smaller micro-batch, scaled back to the full batch): the unchanged config does not fit in it.
    as_is_oom_budget: int | None = None
    # False: the script updates its parameters by hand (no torch.optim optimizer stepped): there is no
    # optimizer state, and no lever that acts on an optimizer (offloading or quantising its state).
    has_optimizer: bool = True
    # The optimizer classes that stepped (``summary.json``'s ``steps_found.optimizers``); empty: unknown.
    optimizer_classes: tuple[str, ...] = ()
    # The host's measured foreach AdamW rate (bytes of parameters + gradients + state a second) and the
    # CPU threads it ran on (the ``device`` record's ``host_optimizer``); None: not measured.
    host_optimizer_bytes_per_s: float | None = None
    host_threads: int | None = None
    # The profiled device's kind (``cuda``, ``cpu``); None: not recorded (a re-profile record from before).
    device_kind: str | None = None
    # The model whose modules ``candidates`` and ``param_holders`` name (``measure.planned_model``).
    model: int = 0
    # Every predicted reserved peak is multiplied by this (``corrected_workload``: what a verified run
    # measured beyond the prediction); 1.0 as profiled.
    memory_correction: float = 1.0
    # Parameter bytes of each unit full offload shards (FSDP2 ``fully_shard``: a repeated stack's blocks,
    # else the top-level children); the rest of the parameters is the root's unit. Empty: not measured.
    shard_units: tuple[int, ...] = ()
    # Bytes at the peak step held by code outside every child module (the root's own forward code, the
    # loop's loss; ``analysis.layers.outside_holders``): part of ``activations`` and ``temporaries``, so
    # they scale with the micro-batch; no checkpoint candidate and no parameter offload frees them.
    outside_bytes: int = 0
    # Bytes of what the trained model's forward returns besides its loss (a language model's logits), at
    # the full batch (``splits.output_bytes``): a split inside the forward keeps the earlier
    # micro-batches' outputs while the last one runs, so they do not all shrink with the micro-batch
    # there (``memory.held_outputs``); they do under the script's own arguments and the DataLoader
    # split. 0: not measured.
    root_output_bytes: int = 0
    # The autocast the script runs under itself ("bf16", "fp16"; None: none), measured by the precision
    # collector; ``script_precision`` is its one-line description (None: not measured, fp32 assumed).
    script_autocast: str | None = None
    script_precision: str | None = None
    script_tf32: bool | None = None  # the script's fp32 matmuls may use TF32 (a CUDA run; None: unknown)
    # Module names of ``shard_units``, in the same order (FSDP2's ``shard_modules``); empty: not known.
    shard_names: tuple[str, ...] = ()
    # The measured optimizer phase of a step (ms): FSDP2 steps 1/N of the state on each rank.
    optimizer_ms: float | None = None
    # A measured collective rate between the ranks (the trace's ``device.link`` record: bus bytes a
    # second of an all-reduce, its backend and world size); None: not measured.
    link_bytes_per_s: float | None = None
    link_backend: str | None = None
    link_world_size: int | None = None
    # The ranks of the job the trace measured (its header's ``distributed.world_size``): a rank's trace
    # is planned from its one-process equivalent (``memdoctor.plan.parallel.from_rank``); 1: one process.
    measured_world_size: int = 1
    # The activations and gradients the peak step held at the end of its forward (``parallel_fsdp.
    # forward_end``: a peak in the optimizer step holds few activations, and FSDP2 moves a rank's peak
    # into the forward or backward); None: not measured (the peak's own figures are taken).
    forward_end_activations: int | None = None
    forward_end_gradients: int | None = None

    def adds_autocast(self, precision: str) -> bool:
        """Whether a config's ``precision`` changes the script: autocast where it runs none. Under its
        own autocast memdoctor adds none (``memdoctor.levers.autocast`` keeps the script's), so no
        activation, weight-cache or time change is predicted from it."""
        return precision != "fp32" and self.script_autocast is None

    # How micro-batching applies to this script (``memdoctor.plan.splits``): in the forward, at the
    # DataLoader, through its own arguments, or not at all (``split.why_not``).
    split: Split = AS_BEFORE


def corrected_workload(w: Workload, factor: float) -> Workload:
    """``w`` with every predicted reserved peak raised ``factor``-fold.

    The planner predicts reserved = allocated x ``reserved_ratio(w, config)`` and checks the budget
    against it; ``memory_correction`` multiplies that ratio after the calibrated floors of a changed
    config (scaling the measured ratio itself, as before, was swallowed by those floors: a x1.11
    correction of a measured 1.02 stayed under the 1.15 of a checkpointed config and changed nothing).
    No other part of the model changes. It is deliberately blunt (the whole peak, not the part that
    was wrong) and so errs towards memory."""
    note = f"memory predictions raised x{factor:.3f}: a verified run measured that much more than predicted"
    return replace(w, memory_correction=w.memory_correction * factor, notes=[*w.notes, note])
