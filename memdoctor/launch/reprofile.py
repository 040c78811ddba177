"""Re-profile at a smaller micro-batch when the run ran out of memory in a step it never finished.

Why and what the planner does with it: ``memdoctor.plan.reprofiled``. This module runs the profiles:
the same script, arguments, budget and warm-up, one profiled step, with only gradient accumulation
applied (``PlanConfig(micro_batch=B/k, accumulation_steps=k)``, through ``memdoctor run``'s own
micro-batching), for k = 2, 4, 8, ... until a run's ledger has every module (for a run that died
after every module had run: until a step completes). The batch is split the way
the script allows (``memdoctor.plan.splits.reprofile_splits``): inside the forward when it returns the
loss, at the DataLoader when the loop computes it, or through the script's own batch-size and
accumulation arguments; a run that died before its loss was seen tries them in that order (a split
that does not apply stops its round at once, with a config error). Where none applies (or every split
tried was refused), one round profiles the full batch with every repeated block checkpointed instead
(``memdoctor.launch.reprofile_checkpoint``), which needs no split; the record says why no split
applied. A round whose run still dies is not repeated as it was: micro-batch rounds halve the
micro-batch only while the forward gets further, and the checkpointed round runs once. Each run
writes into its own folder inside the first one (``OUT/reprofile``, ``OUT/reprofile-2``, ...), never
over the first run's files. The result is the run-wide record ``reprofile`` that ``launch/rounds.py``
writes into the FIRST trace; its ``workload`` is what the plan (and ``--verify``) then plan from.

No micro-batch round runs where none can help: when the model's state alone (parameters, gradients,
optimizer state: ``plan.reprofiled.model_state``, known from the model's discovery even in a run that
died in its first step) exceeds the budget, a smaller micro-batch, which shrinks only activations,
cannot fit it (a 1.1B fp32 decoder under 8 GiB was re-profiled three times in vain); and the halving
stops after a round that died where the run before it died, at the same peak.

The profile runner is a parameter, so the loop is testable without a child process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memdoctor import exitcodes
from memdoctor.analysis.faults import died_in
from memdoctor.config import PlanConfig
from memdoctor.launch.reprofile_checkpoint import checkpoint_round, round_entry
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult, Runner, Say
from memdoctor.outputs import round_folder
from memdoctor.plan.measure import batch_size
from memdoctor.plan.reprofiled import (
    RECORD_NAME,
    as_record,
    reprofile_workload,
    state_beyond,
    unmeasured_modules,
)
from memdoctor.plan.splits import Split, reprofile_splits, split_of
from memdoctor.plan.summarize import summary_target
from memdoctor.trace import Trace, read_trace
from memdoctor.units import first_names, format_bytes

__all__ = ["RECORD_NAME", "needed", "reprofile", "why"]

SHOWN = 3  # unmeasured modules named on the terminal
# A round that ran out of memory where the run before it did, at a peak within this share of that run's
# (either way), shows that what runs out does not shrink with the batch: halving again cannot help. (A
# CUDA run that runs out of memory peaks near its cap wherever it dies; where it died tells the rounds
# apart.) A clearly higher peak at the "same" place got further: the minimal GPT on the H200 died in its
# root's logits upcast at 5.78 GiB, and at micro-batch 1/2 in the first backward, before any module's
# backward hook, at 7.67 GiB; taken as "the same peak", the halving stopped and no plan was measured.
SAME_PEAK = 0.95
Run = tuple[Trace | None, dict[str, Any] | None]  # a run's trace and summary (None: not read)


def needed(trace: Trace | None, result: ProfileResult) -> str | None:
    """Why a re-profile is needed, or None. A run that ran out of memory in a step it never finished,
    wherever it died: in a child module's forward (the modules after it unmeasured), or after every
    module ran (the root's own code, such as a logits upcast, a loss computed in the loop, backward, the
    optimizer step): its peak was never measured either way."""
    if trace is None or result.exit_code != exitcodes.OUT_OF_MEMORY:
        return None
    if trace.header.get("applied_config") is not None:  # profile --config: the script is not as it is
        return None
    return why(trace)


def why(trace: Trace) -> str | None:
    """What the run's last step left unmeasured, in a line; None when every step finished."""
    missing = unmeasured_modules(trace)
    if missing:
        return f"the run died before its forward finished; never measured: {first_names(missing, SHOWN)}"
    where = died_in(trace)
    if where is None:
        return None
    return f"the run died in {where}, in a step it never finished: its peak was not measured"


def reprofile(
    trace: Trace,
    summary: dict[str, Any],
    request: ProfileRequest,
    run: Runner,
    say: Say,
    *,
    max_rounds: int,
) -> dict[str, Any]:
    """Re-profile at micro-batches 1/2, 1/4, ... (at most ``max_rounds`` runs); the ``reprofile`` record."""
    missing = unmeasured_modules(trace)
    batch = batch_size(summary)
    target = summary_target(summary)
    record: dict[str, Any] = {
        "unmeasured_modules": missing,
        "batch_size": batch,
        "max_rounds": max_rounds,
        "rounds": [],
        "used_round": None,
        "accumulation_steps": None,
        "workload": None,
        "stopped": None,
        "method": "micro_batch",  # or "checkpoint": the last resort, where no split applies
        "why_no_split": None,
        "checkpointed": [],
    }
    say(f"reprofile: {why(trace) or 'the run ran out of memory'}")
    budget = target.budget_bytes if target else None
    record["stopped"] = state_beyond(trace, _optimizers(summary), budget)
    splits = reprofile_splits(trace)
    if record["stopped"] is not None:
        say(f"reprofile: {record['stopped']}; the plan is made from the first run (a lower bound)")
        return record
    if not splits:
        record["why_no_split"] = split_of(trace).why_not or "no micro-batch split applies to this script"
        return _last_resort(1, trace, request, run, say, budget, record, max_rounds)
    before, n, k = len(missing), 0, 2
    finish = not before  # a run that died after every module ran: planned from a round whose step completed
    last: Run = (trace, summary)
    while n < max_rounds:
        n += 1
        if batch is not None and k > batch:
            record["stopped"] = f"a micro-batch of 1 (of {batch}) still did not measure every module"
            break
        r, w, this = _one(n, k, batch, request, run, say, budget, splits[0], finish)
        record["rounds"].append(r)
        if w is not None:
            record.update(used_round=n, accumulation_steps=k, workload=as_record(w))
            say(f"reprofile: planning from micro-batch 1/{k}, scaled back to the full batch")
            return record
        if r["exit_code"] == exitcodes.USAGE_ERROR and len(splits) > 1:
            say(f"reprofile {n}: the {splits[0].kind} split does not apply ({r['message']}); trying the next")
            splits.pop(0)
            continue  # the same micro-batch, split another way
        if r["exit_code"] == exitcodes.USAGE_ERROR:  # the last split refused too: none applies
            record["why_no_split"] = refused(splits[0].kind, r["message"])
            return _last_resort(n + 1, trace, request, run, say, budget, record, max_rounds)
        if r["exit_code"] not in (exitcodes.OK, exitcodes.OUT_OF_MEMORY):
            record["stopped"] = f"the re-profiled run failed ({r['status']}: {r['message']})"
            break
        left = r["unmeasured_modules"]
        if left is None or (before and left >= before):
            record["stopped"] = (
                f"at micro-batch 1/{k} the run got no further in its forward ({left} unmeasured "
                f"module{'' if left == 1 else 's'}, {before} before): what runs out of memory does not "
                "shrink with the batch"
            )
            break
        oom = r["exit_code"] == exitcodes.OUT_OF_MEMORY
        record["stopped"] = _no_use(last, this, k, budget, further=left < before) if oom else None
        if record["stopped"] is not None:
            break
        before, k, last = left, k * 2, this
    else:
        record["stopped"] = f"no re-profile measured every module in {max_rounds} rounds (--reprofile)"
    say(f"reprofile: {record['stopped']}; the plan is made from the first run (a lower bound)")
    return record


def refused(kind: str | None, message: str) -> str:
    """Why no split applies, when the last one tried was refused: its first reason, without the advice
    the refusal goes on with (``memdoctor run``'s config error)."""
    reason = message.removeprefix("the plan could not be applied: ")
    reason = reason.split(", so ")[0].split("; ")[0]
    return f"no micro-batch split applies: the {kind} split was refused ({reason})"


def _last_resort(
    n: int,
    trace: Trace,
    request: ProfileRequest,
    run: Runner,
    say: Say,
    budget: int | None,
    record: dict[str, Any],
    max_rounds: int,
) -> dict[str, Any]:
    """Where no split applies: round ``n`` with every repeated block checkpointed
    (``memdoctor.launch.reprofile_checkpoint``), when ``max_rounds`` allows one more."""
    if n > max_rounds:
        record["stopped"] = (
            f"{record['why_no_split']}; no round left for a checkpointed re-profile (--reprofile)"
        )
    else:
        checkpoint_round(n, trace, request, run, say, budget, record)
    if record["workload"] is None:
        say(f"reprofile: {record['stopped']}; the plan is made from the first run (a lower bound)")
    return record


def _optimizers(summary: dict[str, Any] | None) -> list[str]:
    return list(((summary or {}).get("steps_found") or {}).get("optimizers") or [])


def _no_use(last: Run, this: Run, k: int, budget: int | None, *, further: bool) -> str | None:
    """Why halving the micro-batch again cannot help, after a round at 1/``k`` that ran out of memory
    again: the model's state measured in it alone exceeds the budget (it may know the optimizer the
    first run died before), or it got no ``further`` in its forward and died where the run before it
    died, at the same peak (within ``SAME_PEAK``, either way): the memory that runs out did not shrink
    with the batch, and will not at 1/2``k`` either."""
    trace, summary = this
    if trace is None:
        return None
    beyond = state_beyond(trace, _optimizers(summary), budget)
    if beyond is not None:
        return f"at micro-batch 1/{k}, {beyond}"
    where, peak, peak_before = died_in(trace), _peak(summary), _peak(last[1])
    if further or where is None or last[0] is None or where != died_in(last[0]):
        return None
    if not peak or not peak_before or abs(peak - peak_before) > (1 - SAME_PEAK) * peak_before:
        return None
    return (
        f"at micro-batch 1/{k} the run died again in {where} at the same peak ({format_bytes(peak)}, "
        f"{format_bytes(peak_before)} before): what runs out of memory does not shrink with the batch"
    )


def _peak(summary: dict[str, Any] | None) -> int | None:
    peak = (summary or {}).get("peak_memory_bytes")
    return int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None


def _one(
    n: int,
    k: int,
    batch: int | None,
    request: ProfileRequest,
    run: Runner,
    say: Say,
    oom_budget: int | None,
    split: Split,
    finish: bool,
) -> tuple[dict[str, Any], Any, Run]:
    """Round ``n`` at micro-batch 1/``k``, split as ``split`` says (``memdoctor.plan.splits``): its
    record, its full-batch workload when it measured every module, and with ``finish`` its step
    completed too (else None), and its trace and summary."""
    micro = batch // k if batch and batch % k == 0 else None
    size = f"{micro} of {batch}" if micro else f"1/{k} of the batch"
    say(f"reprofile {n}: profiling at micro-batch {size} (gradient accumulation {k}, split {split.kind}) ...")
    out = round_folder(request.out_dir, "reprofile", n)
    config = PlanConfig(
        micro_batch=micro,
        accumulation_steps=k,
        accumulation_split=split.kind,
        script_args=tuple(split.script_args(k)),
    )
    result = run(dataclasses.replace(request, out_dir=out, steps=1, config=config.as_dict()))
    trace = read_trace(result.trace_path)
    missing = unmeasured_modules(trace) if trace is not None else None
    w = None
    measured = result.exit_code in (exitcodes.OK, exitcodes.OUT_OF_MEMORY)  # not a script failure
    if finish:
        measured = result.exit_code == exitcodes.OK
    if measured and trace is not None and result.summary is not None and missing == []:
        # planned with the split that measured it
        w = reprofile_workload(trace, result.summary, k, batch, oom_budget, split)
    shape = {"accumulation_steps": k, "micro_batch": micro, "split": split.kind}
    r = round_entry(n, shape, out, result, missing, measured=w is not None)
    verdict = (
        "measured every module"
        if w is not None
        else f"{result.status}; still unmeasured: {r['unmeasured_modules']}"
    )
    say(f"reprofile {n}: {verdict}")
    return r, w, (trace, result.summary)
