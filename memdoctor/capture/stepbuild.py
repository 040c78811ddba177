"""Turning one step's raw samples into a ``StepRecord``: phases, peak, per-module columns, timeline.

Runs once per step, after the hooks have done their cheap appends: markers are resolved to
milliseconds here (one wait for the GPU per step), and everything is derived from the samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memdoctor.capture import gradnorms
from memdoctor.capture.engines import BUCKETS, SHARDING, SHARDING_COLUMN
from memdoctor.capture.stepmodules import close_open_backward, module_columns
from memdoctor.device import Device
from memdoctor.trace import StepRecord


class Sample(NamedTuple):
    marker: Any
    event: str
    key: int | None
    depth: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    mem: tuple[int, int, int] | None  # allocator (allocated, reserved, max_allocated)
    # The engines' categories (memdoctor.capture.engines): DDP's bucket bytes no gradient counts,
    # FSDP2's gathered and reduce buffers. 0 in one plain process.
    buckets: int = 0
    sharding: int = 0


@dataclass
class StepData:
    """What the hooks gather during one optimizer step."""

    step: int
    samples: list[Sample] = field(default_factory=list)
    phase: str = "other"
    forwards: int = 0
    opt_posts: int = 0
    saved_total: int = 0
    t0_unix: float = field(default_factory=time.time)
    act_self: dict[int, int] = field(default_factory=dict)
    act_incl: dict[int, int] = field(default_factory=dict)
    ckpt_free: dict[int, int | None] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    fwd_pairs: list[tuple[int, int, int]] = field(default_factory=list)
    bwd_pairs: list[tuple[int, int, int]] = field(default_factory=list)
    bwd_open: dict[int, list[int]] = field(default_factory=dict)
    bwd_since_fwd: bool = False
    grad_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    opt_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    # storage address -> bytes of the tensors of each category seen this step (for the history ledger)
    saved_ptrs: dict[int, int] = field(default_factory=dict)
    grad_ptrs: dict[int, int] = field(default_factory=dict)
    opt_ptrs: dict[int, int] = field(default_factory=dict)
    history: list[dict[str, Any]] | None = None
    history_baseline: int = 0
    # module key -> [inclusive saved bytes, checkpoint-free bytes or None, calls] of the micro-batch
    # in progress; folded into the step by max (activations) and sum (calls).
    micro: dict[int, list[Any]] = field(default_factory=dict)
    # Gradient norms (detailed steps): launched at the optimizer step, read in build_step only.
    grad_norms: gradnorms.GradNorms | None = None
    grad_order: dict[int, int] = field(default_factory=dict)  # parameter id -> backward accumulation rank
    grad_norm_field: dict[str, Any] | None = None  # the step record's grad_norm, set by build_step
    # (id of the top-level module running or None, code site) -> bytes saved for backward outside every
    # child module: the root's own forward code, or the loop's (``Ledger.saved_outside``); of the
    # micro-batch in progress and, folded by max, of the step.
    outside_micro: dict[tuple[int | None, str], int] = field(default_factory=dict)
    outside: dict[tuple[int | None, str], int] = field(default_factory=dict)
    outside_samples: int = 0
    # A torch.amp.GradScaler's device copy of the step's loss scale, and whether it skipped the step.
    loss_scale: Any = None
    scaler_stepped: bool = False
    scaler_skipped: bool = False
    # (model, module index) -> the most bytes of FSDP2 buffers holding its parameters at once this step
    sharding_bytes: dict[tuple[int, int], int] = field(default_factory=dict)

    def fold_micro(self) -> None:
        """Fold the finished micro-batch into the step: activations are the largest micro-batch's."""
        for key, (incl, ckpt, calls) in self.micro.items():
            self.act_incl[key] = max(self.act_incl.get(key, 0), incl)
            self.calls[key] = self.calls.get(key, 0) + calls
            if ckpt is None:
                self.ckpt_free[key] = None
            elif self.ckpt_free.get(key, 0) is not None:
                self.ckpt_free[key] = max(self.ckpt_free.get(key) or 0, ckpt)
        self.micro = {}
        for site, n in self.outside_micro.items():
            self.outside[site] = max(self.outside.get(site, 0), n)
        self.outside_micro = {}

    def close_backward_pass(self) -> None:
        """A new forward starts (a micro-batch, or LBFGS calling its closure again): modules whose
        inputs take no gradient never report their backward's end, so their spans still open end at
        the last backward sample so far. Left open, the next pass's first backward end would pair with
        them, and every pair after it would span two passes."""
        if not any(self.bwd_open.values()):
            return
        last = next((i for i in range(len(self.samples) - 1, -1, -1) if self.samples[i].event[0] == "b"), -1)
        for key, starts in self.bwd_open.items():
            self.bwd_pairs += [(key, start, last) for start in starts if start <= last]
            starts.clear()

    def last_opt_post_index(self) -> int:
        for i in range(len(self.samples) - 1, -1, -1):
            if self.samples[i].event == "opt_post":
                return i
        return len(self.samples) - 1


# "outside": a tensor saved outside every module (the loop's loss): the forward pass, as the user sees it.
_EVENT_PHASE = {
    "fwd_post": "forward",
    "outside": "forward",
    "bwd_pre": "backward",
    "bwd_post": "backward",
    "opt_post": "optimizer",
}


def interval_phases(samples: list[Sample]) -> list[str]:
    """The phase of the interval that ends at each sample. Inside an optimizer step (between its pre-
    and post-hook) what is not forward or backward is the optimizer's own work: LBFGS runs its closure,
    a forward and a backward, several times in one step, and works between those calls."""
    phases: list[str] = []
    in_opt = False
    for s in samples:
        if s.event == "fwd_pre":
            phase = "forward" if s.depth > 0 else "other"
        elif s.event == "fault":
            phase = phases[-1] if phases else "other"
        else:
            phase = _EVENT_PHASE.get(s.event, "other")
        phases.append("optimizer" if in_opt and phase == "other" else phase)
        if s.event == "opt_pre":
            in_opt = True
        elif s.event == "opt_post":
            in_opt = False
    return phases


def build_step(
    data: StepData,
    *,
    upto: int,
    device: Device,
    index: dict[int, tuple[int, int]],
    warmup: bool,
    complete: bool,
    param_ptrs: dict[int, int] | None = None,
    release: bool = True,
    detailed: bool = True,
    parents: dict[int, list[int]] | None = None,
    engines: tuple[str, ...] = (),
) -> StepRecord:
    """The step's record from its samples; ``engines`` names the engines' categories this run has
    (``gradient_buckets``, ``sharding_buffers``: ``memdoctor.capture.engines``), which then appear
    in ``categories_at_peak`` and the timeline."""
    samples = data.samples[:upto]
    markers = [s.marker for s in samples]
    t_ms = device.resolve_ms(markers)
    phases = interval_phases(samples)
    phases_ms = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}
    for i in range(1, len(samples)):
        phases_ms[phases[i]] += max(0.0, t_ms[i] - t_ms[i - 1])
    close_open_backward(data, samples)
    memory = _peak(samples, t_ms, phases, index, device, engines)
    if data.history:
        memory["peak_ledger"] = _history_ledger(data, samples, param_ptrs)
    if detailed:
        memory["outside_modules"] = outside_holders(data.outside, index)
    record = StepRecord(
        step=data.step,
        warmup=warmup,
        complete=complete,
        duration_ms=round(t_ms[-1], 4) if t_ms else None,
        phases_ms={k: round(v, 4) for k, v in phases_ms.items()},
        micro_batches=max(1, data.forwards),
        memory=memory,
        modules=module_columns(data, t_ms, index, parents or {}) if detailed else {},
        timeline=_timeline(samples, t_ms, phases, index, device.has_allocator, engines),
        detail="full" if detailed else "timing",
    )
    if detailed:
        _add_grad_norms(data, record.modules)
        if SHARDING in engines:
            _add_sharding_column(data, record.modules)
    if not detailed:
        # A timing step has no module or saved-tensor hooks: its allocator peak is measured, but
        # not what made it up, and forward and backward are not told apart.
        memory["categories_at_peak"] = None
        memory["accounted_bytes"] = None
    if complete and release:
        device.release_markers(markers[:-1])
    return record


def outside_holders(
    outside: dict[tuple[int | None, str], int], index: dict[int, tuple[int, int]]
) -> list[dict[str, Any]]:
    """The step's ``memory.outside_modules``: bytes saved for backward by code outside every child
    module, by holder and line, largest first. ``holder`` is ``root`` (a model's own forward code, the
    root module on the stack) or ``loop`` (no module of any model running: the script's loss, or a
    parameterless module such as ``nn.CrossEntropyLoss`` called from the loop)."""
    held: dict[tuple[str, int | None, str], int] = {}
    for (key, site), n in outside.items():
        loc = index.get(key) if key is not None else None
        if loc is not None and loc[1] != 0:
            continue  # a model's child called from the loop: its own figures hold what it saved
        at = ("root", loc[0], site) if loc is not None else ("loop", None, site)
        held[at] = held.get(at, 0) + n
    rows = [{"holder": h, "model": m, "site": site, "bytes": n} for (h, m, site), n in held.items()]
    return sorted(rows, key=lambda r: (-r["bytes"], r["holder"], r["site"]))


def _add_grad_norms(data: StepData, modules: dict[int, dict[str, list[Any]]]) -> None:
    """Read the step's gradient norms to the host (the step's GPU work is done by now) and add the
    ``grad_norm`` and ``grad_nonfinite`` columns; ``data.grad_norm_field`` is the step's summary."""
    data.grad_norm_field = None
    if data.grad_norms is None:
        return
    sizes = {m: len(cols["calls"]) for m, cols in modules.items()}
    try:
        cols, data.grad_norm_field = gradnorms.step_figures(data.grad_norms, data.grad_order, sizes)
    except Exception:  # the device failed (a step cut short by a CUDA error), or our own bug: not measured
        return
    for m, extra in cols.items():
        modules[m].update(extra)


def _history_ledger(
    data: StepData, samples: list[Sample], param_ptrs: dict[int, int] | None
) -> dict[str, Any] | None:
    from memdoctor.capture.history import ledger_at_peak

    first_fwd = next((s for s in samples if s.event == "fwd_pre" and s.depth == 0), samples[0])
    baseline_known = {
        "parameters": samples[-1].parameters,
        "optimizer_state": samples[0].optimizer_state,
        "gradients": first_fwd.gradients,
    }
    known = {
        "activations": data.saved_ptrs,
        "gradients": data.grad_ptrs,
        "optimizer_state": data.opt_ptrs,
        "parameters": param_ptrs or {},
    }
    return ledger_at_peak(
        data.history, baseline=data.history_baseline, baseline_known=baseline_known, known=known
    )


def _add_sharding_column(data: StepData, modules: dict[int, dict[str, list[Any]]]) -> None:
    """``sharding_buffer_bytes``: per ``fully_shard`` module, the most bytes of FSDP2 buffers holding
    its parameters (gathered, all-gather output, reduce-scatter input) live at once in the step."""
    for m, cols in modules.items():
        col = [0] * len(cols["calls"])
        for (model, i), n in data.sharding_bytes.items():
            if model == m and i < len(col):
                col[i] = n
        cols[SHARDING_COLUMN] = col


def _accounted(s: Sample) -> int:
    return s.parameters + s.gradients + s.optimizer_state + s.activations + s.buckets + s.sharding


def _peak(
    samples: list[Sample],
    t_ms: list[float],
    phases: list[str],
    index: dict[int, tuple[int, int]],
    device: Device,
    engines: tuple[str, ...] = (),
) -> dict[str, Any]:
    # The first sample is the previous step's last (its max_allocated is that step's peak).
    with_mem = [i for i, s in enumerate(samples) if s.mem is not None and (i > 0 or s.event == "step_start")]
    if with_mem:
        peak_bytes = max(samples[i].mem[2] for i in with_mem)  # type: ignore[index]
        first = next(i for i in with_mem if samples[i].mem[2] == peak_bytes)  # type: ignore[index]
        prev = max((i for i in with_mem if i < first), default=0)
        at = max(range(prev, first + 1), key=lambda i: _accounted(samples[i]))
        source = "allocator"
    else:
        at = max(range(len(samples)), key=lambda i: _accounted(samples[i]))
        peak_bytes = _accounted(samples[at])
        source = "accounting"
    s = samples[at]
    cats: dict[str, int | None] = {
        "parameters": s.parameters,
        "gradients": s.gradients,
        "optimizer_state": s.optimizer_state,
        "activations": s.activations,
    }
    if BUCKETS in engines:
        cats[BUCKETS] = s.buckets
    if SHARDING in engines:
        cats[SHARDING] = s.sharding
    accounted = _accounted(s)
    cats["other"] = peak_bytes - accounted if source == "allocator" else None
    loc = index.get(s.key) if s.key is not None else None
    return {
        "peak_bytes": int(peak_bytes),
        "peak_source": source,
        "peak_t_ms": round(t_ms[at], 4),
        "peak_phase": _peak_phase(samples, phases, at),
        "peak_model": loc[0] if loc else None,
        "peak_module": loc[1] if loc else None,
        "categories_at_peak": cats,
        "accounted_bytes": int(accounted),
        "allocator": _allocator(samples, with_mem, device),
    }


def _peak_phase(samples: list[Sample], phases: list[str], i: int) -> str:
    """The phase at the peak sample; a sample that ends an interval of "other" (a root forward's or
    the optimizer's pre-hook) opens the phase that follows it, where the memory it holds is used."""
    return peak_phase_at(phases, [s.event for s in samples], i)


def peak_phase_at(phases: list[Any], events: list[Any], i: int) -> str:
    if events[i] == "fwd_pre":
        return "forward"
    if phases[i] == "other" and i + 1 < len(phases):
        return str(phases[i + 1])
    return str(phases[i])


def _allocator(samples: list[Sample], with_mem: list[int], device: Device) -> dict[str, int] | None:
    if not with_mem:
        return None
    first, last = samples[with_mem[0]].mem, samples[with_mem[-1]].mem
    assert first is not None and last is not None
    out = {
        "allocated_start": first[0],
        "allocated_end": last[0],
        "max_allocated": max(samples[i].mem[2] for i in with_mem),  # type: ignore[index]
        "reserved_end": last[1],
    }
    out.update(device.allocator_counters() or {})
    return out


def _timeline(
    samples: list[Sample],
    t_ms: list[float],
    phases: list[str],
    index: dict[int, tuple[int, int]],
    has_allocator: bool,
    engines: tuple[str, ...] = (),
) -> dict[str, list[Any] | None]:
    locs = [index.get(s.key) if s.key is not None else None for s in samples]
    tl: dict[str, list[Any] | None] = {
        "t_ms": [round(t, 4) for t in t_ms],
        "event": [s.event for s in samples],
        "phase": phases,
        "depth": [s.depth for s in samples],
        "model": [loc[0] if loc else None for loc in locs],
        "module": [loc[1] if loc else None for loc in locs],
        "parameters": [s.parameters for s in samples],
        "gradients": [s.gradients for s in samples],
        "optimizer_state": [s.optimizer_state for s in samples],
        "activations": [s.activations for s in samples],
        "allocated": None,
        "reserved": None,
        "max_allocated": None,
    }
    if BUCKETS in engines:
        tl[BUCKETS] = [s.buckets for s in samples]
    if SHARDING in engines:
        tl[SHARDING] = [s.sharding for s in samples]
    if has_allocator:
        tl["allocated"] = [s.mem[0] if s.mem else None for s in samples]
        tl["reserved"] = [s.mem[1] if s.mem else None for s in samples]
        tl["max_allocated"] = [s.mem[2] if s.mem else None for s in samples]
    return tl
