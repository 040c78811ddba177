"""The re-profile of last resort: every repeated block checkpointed, at the full batch.

Where no micro-batch split applies to the script (``memdoctor.plan.splits``: a ``get_batch()`` loop with
no batch-size and accumulation arguments whose model returns no loss), or every split tried was refused,
``memdoctor.launch.reprofile`` runs this one round instead: the same script, arguments and budget, one
profiled step, with ``PlanConfig(checkpoint=<every block of the model's repeated stacks>)`` applied
through ``memdoctor run``'s own checkpointing, whose checkpointed forwards are measured as if not
checkpointed (``ProfileRequest.see_checkpointed``). Checkpointing needs no access to the batch or the
loss. What the planner makes of that run: ``memdoctor.plan.checkpointed``.

It runs once: checkpointing every block is the most a re-profile at the full batch can take away, so a
run that still dies would die again (it is not retried), and the plan is made from the first run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.config import PlanConfig
from memdoctor.config.file import Provenance
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult, Runner, Say
from memdoctor.levers import SEEN_THROUGH  # not levers.install: that imports torch
from memdoctor.outputs import round_folder
from memdoctor.plan.checkpointed import blocks_to_checkpoint, checkpointed_workload
from memdoctor.plan.reprofiled import as_record, unmeasured_modules
from memdoctor.plan.splits import Split
from memdoctor.trace import ModelInfo, Trace, read_trace
from memdoctor.units import first_names

SHOWN = 3


def checkpoint_round(
    n: int,
    trace: Trace,
    request: ProfileRequest,
    run: Runner,
    say: Say,
    oom_budget: int | None,
    record: dict[str, Any],
) -> None:
    """Round ``n``: the first run's script with every repeated block checkpointed; fills ``record``
    (``rounds``, ``method``, ``checkpointed``, and ``workload`` and ``used_round`` when the run finished
    its step and measured every module, else ``stopped``)."""
    info, blocks = blocks_to_checkpoint(trace)
    why = record.get("why_no_split") or "no micro-batch split applies"
    record.update(method="checkpoint", checkpointed=blocks)
    if info is None or not blocks:
        record["stopped"] = f"{why}; and the model has no repeated blocks to checkpoint"
        return
    say(
        f"reprofile {n}: {why}: profiling at the full batch with every repeated block checkpointed "
        f"({len(blocks)}: {first_names(blocks, SHOWN)}) ..."
    )
    config = PlanConfig(
        checkpoint=tuple(blocks),
        provenance=Provenance(
            model_class=info.cls, module_count=len(info.names), param_count=sum(info.param_counts)
        ),
    )
    out = round_folder(request.out_dir, "reprofile", n)
    # every block timed, so that its forward end and backward end are in the timeline (the merge)
    depth = max(request.time_depth or 0, max(_depth(info, info.names.index(b)) for b in blocks))
    result = run(
        dataclasses.replace(
            request, out_dir=out, steps=1, config=config.as_dict(), see_checkpointed=True, time_depth=depth
        )
    )
    second = read_trace(result.trace_path)
    missing = unmeasured_modules(second) if second is not None else None
    w = None
    if result.exit_code == exitcodes.OK and second is not None and result.summary and missing == []:
        w = checkpointed_workload(second, result.summary, blocks, oom_budget) if seen(second) else None
    if (
        w is not None
    ):  # no split applies, whatever the round's own loop facts say (one step may miss the loss)
        w = dataclasses.replace(w, split=Split(None, why), notes=[*w.notes, why])
    shape = {"accumulation_steps": 1, "micro_batch": None, "split": None, "checkpointed": len(blocks)}
    record["rounds"].append(round_entry(n, shape, out, result, missing, measured=w is not None))
    if w is not None:
        record.update(used_round=n, workload=as_record(w))
        say(f"reprofile {n}: measured every module; planning from it, each block's activations added back")
        return
    if result.exit_code == exitcodes.OK and second is not None and not seen(second):
        record["stopped"] = (
            f"{why}; the re-profile with every block checkpointed could not measure the blocks' own "
            "activations (their checkpointing was not memdoctor's, or this torch cannot show them)"
        )
    else:
        record["stopped"] = (
            f"{why}; the re-profile with every block checkpointed ended with {result.status} "
            f"({result.message}): not retried, as checkpointing every block is the most a re-profile at "
            "the full batch can take away"
        )


def round_entry(
    n: int,
    shape: dict[str, Any],
    out: Path,
    result: ProfileResult,
    missing: list[str] | None,
    *,
    measured: bool,
) -> dict[str, Any]:
    """A re-profile round's row in the ``reprofile`` record: its number, how it split or checkpointed
    (``shape``), where its trace is, how it ended and what it left unmeasured; the micro-batch rounds
    (``memdoctor.launch.reprofile``) and the checkpointed one write the same row."""
    return {
        "round": n,
        **shape,
        "trace": f"{out.name}/{result.trace_path.name if result.trace_path else 'trace.jsonl.gz'}",
        "status": result.status,
        "exit_code": result.exit_code,
        "message": result.message,
        "unmeasured_modules": len(missing) if missing is not None else None,
        "measured_every_module": measured,
    }


def _depth(info: ModelInfo, i: int) -> int:
    """Module ``i``'s depth in the model's tree (the root 0): at least its call depth."""
    depth = 0
    while info.parents[i] >= 0:
        i, depth = info.parents[i], depth + 1
    return depth


def seen(trace: Trace) -> bool:
    """Whether the run's checkpointed forwards were measured (``memdoctor.levers.apply.SeeThrough``):
    the checkpointing line ``memdoctor run`` said, as recorded in the trace's events."""
    return any(
        e.get("kind") == "config_applied" and SEEN_THROUGH in str(e.get("message")) for e in trace.events
    )
