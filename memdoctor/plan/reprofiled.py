"""Planning from a re-profile at a smaller micro-batch, for a run that died before its forward finished.

Why: a run that runs out of memory in its first forward leaves every module after the one it died in
unmeasured. Blocks of a repeated stack that never ran can be extrapolated from those that did, but what
comes after the stack cannot: for a language model that is the LM head and the loss, the largest
tensors of the step. GPT-2 small b16 s512 in the HF Trainer died in block 10 of 12 under an 8 GiB cap;
its plan, made without the head, ran out of memory, and ``--verify``'s correction (a factor on the whole
peak) did not reach a plan that fits in three rounds (BENCHMARKS.md, "GPT-2 small with the HF Trainer").

So ``memdoctor profile`` re-profiles such a run with only gradient accumulation applied (the batch split
into ``k`` micro-batches, ``memdoctor.launch.reprofile``), halving the micro-batch until a run measures
every module, and records that run's ``Workload``, scaled back to the full batch, in the first trace
(the run-wide record ``reprofile``). ``workload()`` then plans from it. What scales with the
micro-batch is multiplied by ``k``: the activations at the peak, the temporaries, what each
checkpoint candidate frees (the ledger keeps one micro-batch's figure: the largest call). What does not
is kept: parameters, gradients, optimizer state and the fixed rest, and, where the re-profile split
inside the forward, what that split held of the forward's outputs beyond its micro-batch's share
(``full_batch``). Times stay as measured: the re-profiled step ran the full batch, in ``k``
micro-batches (a module's forward time sums its calls).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import category_columns, peak_step
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.memory import held_outputs
from memdoctor.plan.padding import Padding
from memdoctor.plan.splits import AS_BEFORE, Split, split_from_record
from memdoctor.plan.workload import Candidate, ParamHolder, Workload
from memdoctor.trace import Trace
from memdoctor.units import first_names, format_bytes

RECORD_NAME = "reprofile"
# Module types that hold weights even where the ledger counts none of their own (an LM head tied to the
# embedding: GPT-2's lm_head); with parameter bytes, what ``unmeasured_modules`` looks for.
WEIGHTED = re.compile(r"Linear|Embedding|Conv|Norm", re.I)
# Re-profiles tried at most (micro-batches 1/2, 1/4, 1/8 of the batch) unless ``--reprofile`` says.
DEFAULT_ROUNDS = 3
# Optimizers holding two moments per parameter, each of the parameter's size (torch's Adam family): their
# state counts in what a smaller micro-batch cannot shrink even in a run that died before their first step
# created it. Any other optimizer's state counts only where it was measured. The same set as
# ``memdoctor.capture.hostoptimizer``'s (a test keeps them equal).
TWO_MOMENT_OPTIMIZERS = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax"})


def unmeasured_modules(trace: Trace) -> list[str]:
    """Modules that hold weights and never ran in the peak step of a run cut short in its forward: what
    the ledger could not measure. Empty when the peak step finished or reached its backward (a module
    that never runs in a forward, an unused pooler, is then simply unused)."""
    step = peak_step(trace)
    if step is None or step.complete or step.phases_ms.get("backward"):
        return []
    return [
        r["name"]
        for r in layer_table(trace, step)
        if r["depth"] >= 1 and not r["calls"] and (r["param_bytes"] or WEIGHTED.search(r["type"] or ""))
    ]


def model_state(trace: Trace, optimizers: tuple[str, ...] | list[str]) -> tuple[int, str]:
    """What no smaller micro-batch shrinks, at least, and its parts in words: the parameters on the
    device, every gradient, the optimizer state. Known from the model's discovery on, so even in a run that
    died in its first step: the largest figure the ledger measured (a run that died in its backward holds
    some gradients), else a lower bound from the model record: one gradient byte per trainable parameter
    byte (a backward that finishes holds them all) and, for an optimizer of Adam's family
    (``optimizers``: the classes that stepped, ``steps_found``), two moments per gradient byte."""
    steps = trace.steps
    high = {c: max((int(v or 0) for s in steps for v in category_columns(s)[c]), default=0) for c in _STATE}
    recorded = sum(sum(m.param_bytes) for m in trace.models)
    params = high["parameters"] or recorded
    trainable = sum(sum(m.trainable_param_bytes) for m in trace.models)
    share = trainable / recorded if recorded else 1.0
    grads = max(high["gradients"], int(params * share))
    adam = bool(optimizers) and set(optimizers) <= TWO_MOMENT_OPTIMIZERS
    opt = max(high["optimizer_state"], 2 * grads if adam else 0)
    parts = f"{format_bytes(params)} of parameters + {format_bytes(grads)} of gradients"
    if opt:
        parts += f" + {format_bytes(opt)} of optimizer state"
    return params + grads + opt, parts


_STATE = ("parameters", "gradients", "optimizer_state")


def state_beyond(trace: Trace, optimizers: tuple[str, ...] | list[str], budget: int | None) -> str | None:
    """Why no smaller micro-batch can fit ``budget`` (``model_state`` alone exceeds it), else None."""
    total, parts = model_state(trace, optimizers)
    if budget is None or total <= budget:
        return None
    return (
        f"the model's state alone ({parts} = {format_bytes(total)}) exceeds the {format_bytes(budget)} "
        "budget, which a smaller micro-batch does not shrink (only activations): no re-profile can fit"
    )


def full_batch(w: Workload, k: int, batch: int | None, oom_budget: int | None) -> Workload:
    """The workload measured at micro-batch 1/``k`` as the full batch's (module docstring). Split inside
    the forward (``w.split``: the split the re-profile used), the run held more of the forward's outputs
    than its micro-batch's share (``memory.held_outputs``): that part of its temporaries is not
    multiplied, so that the plan at ``k`` predicts what the re-profile measured. What each module frees
    when checkpointed is multiplied by ``k`` as well, also from a split inside the forward, where the
    ledger sums a module's ``k`` calls (on a CPU loop the summed figure equals the full batch's): on the
    H200, BERT's re-profiled plan taken x1 checkpointed 4 layers and was over-predicted by 10% (90% of
    the hand config), taken x``k`` 3 layers within +2.2% (104%); BENCHMARKS.md, open."""
    part = f" ({batch // k} of {batch})" if batch and batch % k == 0 else ""
    frees = f"what each module frees when checkpointed x{k}"
    outputs = _full_outputs(w, k, batch)
    held = min(held_outputs(outputs, k), w.temporaries) if w.split.kind == "forward" else 0
    note = (
        f"planned from a re-profile at micro-batch 1/{k}{part}: the run as it is died before its forward "
        f"finished. Activations and temporaries are that run's x{k} (they scale with the micro-batch, an "
        f"assumption), {frees}; its step time, of the full batch in {k} micro-batches, is taken as the "
        "full batch's"
    )
    if held:
        note += f"; the earlier micro-batches' outputs its split held ({held} bytes) are not multiplied"
    temporaries = (w.temporaries - held) * k
    return dataclasses.replace(
        w,
        peak_bytes=w.peak_bytes + w.activations * (k - 1) + temporaries - w.temporaries,
        activations=w.activations * k,
        forward_end_activations=None if w.forward_end_activations is None else w.forward_end_activations * k,
        temporaries=temporaries,
        attention_temporaries=w.attention_temporaries * k,
        candidates=[dataclasses.replace(c, free_bytes=c.free_bytes * k) for c in w.candidates],
        batch_size=batch or (w.batch_size * k if w.batch_size else None),
        as_is_oom_budget=oom_budget,
        root_output_bytes=outputs,
        notes=[*w.notes, note],
    )


def _full_outputs(w: Workload, k: int, batch: int | None) -> int:
    """The forward's outputs at the full batch: measured at the re-profile's batch (the full one where
    the forward was split, a micro-batch where the loop ran on micro-batches), scaled to ``batch``."""
    if batch and w.batch_size:
        return w.root_output_bytes * batch // w.batch_size
    return w.root_output_bytes * (1 if w.split.kind == "forward" else k)


def reprofile_workload(
    trace: Trace,
    summary: dict[str, Any],
    k: int,
    batch: int | None,
    oom_budget: int | None,
    split: Split | None = None,
) -> Workload | None:
    """The full-batch workload of a re-profile at micro-batch 1/``k`` split as ``split`` (default: as
    its trace's loop facts allow), with that split (None without a memory figure)."""
    w = measured_workload(trace, summary)
    if w is not None and split is not None:
        w = dataclasses.replace(w, split=split)
    return None if w is None else full_batch(w, k, batch, oom_budget)


# ----------------------------------------------------------------------------------------- the record


def as_record(w: Workload) -> dict[str, Any]:
    """``w`` as plain JSON values (tuples and frozensets as lists)."""
    d = dataclasses.asdict(w)
    d["candidates"] = [
        {**dataclasses.asdict(c), "ancestors": sorted(map(list, c.ancestors))} for c in w.candidates
    ]
    if w.padding is not None:
        d["padding"] = {**dataclasses.asdict(w.padding), "longest": list(w.padding.longest)}
    d["scale_window_log2"] = list(w.scale_window_log2) if w.scale_window_log2 else None
    return d


def from_record(d: dict[str, Any]) -> Workload:
    """The ``Workload`` of ``as_record``; ``KeyError``/``TypeError``/``ValueError`` when it is not one."""
    fields = {f.name for f in dataclasses.fields(Workload)}
    values = {k: v for k, v in d.items() if k in fields}
    values["candidates"] = [
        Candidate(**{**c, "ancestors": frozenset((int(a), int(b)) for a, b in c["ancestors"])})
        for c in d["candidates"]
    ]
    pad = d.get("padding")
    values["padding"] = None if pad is None else Padding(**{**pad, "longest": tuple(pad["longest"])})
    values["param_holders"] = [ParamHolder(**h) for h in d.get("param_holders") or []]
    values["shard_units"] = tuple(int(b) for b in d.get("shard_units") or ())
    values["shard_names"] = tuple(str(n) for n in d.get("shard_names") or ())
    values["optimizer_classes"] = tuple(str(c) for c in d.get("optimizer_classes") or ())
    window = d.get("scale_window_log2")
    values["scale_window_log2"] = tuple(window) if window else None
    values["notes"] = [str(n) for n in d.get("notes") or []]
    values["split"] = split_from_record(d.get("split")) or AS_BEFORE
    return Workload(**values)


def reprofiled_workload(trace: Trace) -> Workload | None:
    """The full-batch workload a re-profile recorded in ``trace``; None when there is none (or the record
    is not a workload: a hand-edited trace then plans from its own measurements)."""
    record = trace.collected.get(RECORD_NAME)
    found = record.get("workload") if isinstance(record, dict) else None
    if not isinstance(found, dict):
        return None
    try:
        return from_record(found)
    except (KeyError, TypeError, ValueError):
        return None


def summary_record(trace: Trace) -> dict[str, Any] | None:
    """``summary.json``'s ``reprofile``: what was re-profiled and which run the plan comes from (the
    workload itself stays in the trace); None when the run was not re-profiled. Tolerates a hand-edited
    record: a trace is input."""
    record = trace.collected.get(RECORD_NAME)
    if not isinstance(record, dict):
        return None
    found = record.get("rounds")
    rounds = [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []
    keys = (
        "round",
        "accumulation_steps",
        "micro_batch",
        "trace",
        "status",
        "unmeasured_modules",
        "checkpointed",
    )
    missing = record.get("unmeasured_modules")
    blocks = record.get("checkpointed")
    why = record.get("why_no_split")
    return {
        "unmeasured_modules": [str(m) for m in missing] if isinstance(missing, list) else [],
        "batch_size": _int(record.get("batch_size")),
        "rounds": [{k: r.get(k) for k in keys} for r in rounds],
        "used_round": _int(record.get("used_round")),
        "accumulation_steps": _int(record.get("accumulation_steps")),
        "planned_from_reprofile": reprofiled_workload(trace) is not None,
        "stopped": None if record.get("stopped") is None else str(record.get("stopped")),
        # "checkpoint": no micro-batch split applied (``why_no_split``), so the re-profile checkpointed
        # every repeated block (``checkpointed``) at the full batch (``memdoctor.plan.checkpointed``)
        "method": "checkpoint" if record.get("method") == "checkpoint" else "micro_batch",
        "why_no_split": None if why is None else str(why),
        "checkpointed": [str(b) for b in blocks] if isinstance(blocks, list) else [],
    }


def peak_words(trace: Trace, w: Workload) -> str:
    """The peak a plan is made from, with its kind: ``11.76 GiB allocated peak, extrapolated to the full
    batch from the re-profile at micro-batch 1/2``. It differs by design from the peak the run as it
    is measured (a run that died measured only what it reached), so every sentence quoting it says
    which one it is."""
    text = f"{format_bytes(w.peak_bytes)} allocated peak"
    found = summary_record(trace)
    if found is None or not found["planned_from_reprofile"]:
        return text + (", measured" if w.complete else ", measured until the run died")
    if found["method"] == "checkpoint":
        return text + ", rebuilt from the re-profile with every repeated block checkpointed"
    k = found["accumulation_steps"]
    return text + f", extrapolated to the full batch from the re-profile at micro-batch 1/{k}"


def advice(found: dict[str, Any]) -> str:
    """The plan's first line about the re-profile (``found``: ``summary_record``'s)."""
    names = found["unmeasured_modules"]
    shown = first_names(names, 3)
    died = f"the script as it is ran out of memory before its forward reached {shown}"
    if not names:  # every module ran: it died in the root's own code, the loop's loss, backward, optimizer
        died = "the script as it is ran out of memory after every module had run, in a step it never finished"
    if not found["planned_from_reprofile"]:
        return f"{died}; no re-profile measured them ({found['stopped']}): every prediction is a lower bound"
    k = found["accumulation_steps"]
    used: dict[str, Any] = next((r for r in found["rounds"] if r["round"] == found["used_round"]), {})
    where = f" ({used['trace']})" if used.get("trace") else ""
    if found["method"] == "checkpoint":
        blocks = found["checkpointed"]
        return (
            f"{died}; {found['why_no_split'] or 'no micro-batch split applies'}, so memdoctor re-profiled "
            f"it at the full batch with every repeated block checkpointed ({len(blocks)}: "
            f"{first_names(blocks, 3)}){where}, and this plan is made from that run, each block's "
            "activations measured in its forward and added back"
        )
    return (
        f"{died}; memdoctor re-profiled it at micro-batch 1/{k}{where} and this plan is made from that run, "
        f"its activations scaled x{k} back to the full batch"
    )


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None
