"""Which micro-batch split ``memdoctor run`` can apply to this script, known before it is proposed.

Read from the data collector's ``loop`` facts (docs/trace-format.md), in the order an expert would try:

1. ``arguments``: the script parses a batch-size and a gradient-accumulation argument, or has such
   config variables that a configurator verifiably sets from ``--name=value`` in argv (nanoGPT's
   ``configurator.py``; ``style`` "argv"): pass smaller batches and more accumulation steps, the
   effective batch unchanged (``memdoctor.levers.scriptargs``). First: the script's own loop then
   runs each micro-batch, so everything it holds per batch shrinks with it. A split inside the
   forward keeps the earlier micro-batches' outputs while the last one runs (a minimal GPT's logits:
   0.41 and 0.63 GB more than its own loop at 3 and 4 micro-batches on the H200; the memory model
   counts them, ``memory.held_outputs``).
2. ``forward``: the trained model's forward returns its loss (a tensor, a tuple's element, a ``loss``
   key or attribute): split inside the forward (``memdoctor.levers.microbatch``).
3. ``loader``: the loop computes the loss, its training batches come from a DataLoader read at most
   one batch ahead (``accelerate``'s prepared loaders), a ``torch.optim`` optimizer steps, and
   accelerate does not accumulate by itself: split each batch at the loader and defer the step
   (``memdoctor.levers.loopsplit``).

Otherwise no split is safe, and ``why_not`` says precisely why; the planner then plans without
micro-batching. A trace from before these facts were recorded plans as before (``forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memdoctor.trace import Trace


@dataclass(frozen=True)
class Split:
    """How micro-batching applies (``kind``), or why it cannot (``why_not``)."""

    kind: str | None
    why_not: str | None = None
    batch_option: str | None = None
    batch_value: int | None = None
    accumulation_option: str | None = None
    accumulation_value: int | None = None
    style: str = "argparse"  # or "argv": ``--name=value`` entries a configurator reads

    def allows(self, k: int) -> bool:
        """Whether ``k`` micro-batches can be planned (the script's batch argument divides by ``k``)."""
        if k == 1:
            return True
        if self.kind == "arguments":
            return self.batch_value is not None and self.batch_value % k == 0 and self.batch_value >= k
        return self.kind is not None

    def script_args(self, k: int) -> list[str]:
        """The arguments that make ``k`` micro-batches of the script's batch (``arguments`` only)."""
        if self.kind != "arguments" or k == 1 or not self.allows(k):
            return []
        assert self.batch_option and self.accumulation_option and self.batch_value
        steps = (self.accumulation_value or 1) * k
        pairs = [(self.batch_option, self.batch_value // k), (self.accumulation_option, steps)]
        if self.style == "argv":
            return [f"{option}={value}" for option, value in pairs]
        return [str(part) for pair in pairs for part in pair]


AS_BEFORE = Split("forward")


def split_of(trace: Trace | Any) -> Split:
    """The split the trace's loop facts allow (module docstring)."""
    facts = _facts(trace)
    loop = facts.get("loop")
    if not isinstance(loop, dict):
        return AS_BEFORE
    loss = loop.get("loss")
    found = loop.get("knobs")
    knobs: dict[str, Any] = found if isinstance(found, dict) else {}
    if not isinstance(loss, dict):
        return AS_BEFORE  # no training forward seen (a run that died first): as before
    arguments = _arguments(knobs)
    if arguments is not None:
        return arguments
    if loss.get("in_forward"):
        return AS_BEFORE
    lookahead = facts.get("lookahead")
    own = loop.get("accelerate_accumulation")
    if loop.get("loader") and loop.get("torch_optim") and not _deep(lookahead) and not _many(own):
        return Split("loader")
    return Split(None, _why_not(loss, loop, lookahead, knobs))


def _arguments(knobs: dict[str, Any]) -> Split | None:
    """The ``arguments`` split where the script parses both a batch-size and an accumulation option."""
    if not (
        knobs.get("batch_option") and knobs.get("accumulation_option") and _int(knobs.get("batch_value"))
    ):
        return None
    return Split(
        "arguments",
        batch_option=str(knobs["batch_option"]),
        batch_value=_int(knobs.get("batch_value")),
        accumulation_option=str(knobs["accumulation_option"]),
        accumulation_value=_int(knobs.get("accumulation_value")) or 1,
        style="argv" if knobs.get("style") == "argv" else "argparse",
    )


def _why_not(loss: dict[str, Any], loop: dict[str, Any], lookahead: Any, knobs: dict[str, Any]) -> str:
    where = loss.get("why") or "the loop computes the loss"
    if loop.get("loader") and not loop.get("torch_optim"):
        source = "batches come from a DataLoader but no torch.optim optimizer steps (whose step could wait)"
    elif loop.get("loader") and _many(loop.get("accelerate_accumulation")):
        source = (
            f"the script accumulates through accelerate (gradient_accumulation_steps="
            f"{loop.get('accelerate_accumulation')}), which would step on memdoctor's micro-batches"
        )
    elif loop.get("loader"):
        source = f"the DataLoader is read {lookahead} batches ahead (memdoctor run splits at most one ahead)"
    else:
        source = "batches do not come from a DataLoader"
    if knobs.get("batch_option"):
        kind = "config variable" if knobs.get("style") == "argv" else "argument"
        args = f"the script has a batch-size {kind} ({knobs['batch_option']}) but no accumulation {kind}"
    else:
        args = (
            "the script has no batch-size and accumulation arguments (argparse), nor such config "
            "variables that a configurator sets from --name=value"
        )
    return f"no safe micro-batch split: {where}; {source}; {args}"


def _many(steps: Any) -> bool:
    """accelerate's own accumulation over more than one batch (``levers.loopsplit`` refuses it)."""
    return isinstance(steps, int) and steps > 1


def _deep(lookahead: Any) -> bool:
    """A look-ahead the loader split cannot follow: more than one batch (``levers.loopsplit``)."""
    return isinstance(lookahead, int) and lookahead > 1


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def reprofile_splits(trace: Trace | Any) -> list[Split]:
    """The splits a re-profile at a smaller micro-batch can try, best first. A run that died in its
    first forward never showed where its loss is: then every split its loop allows is tried in turn
    (the script's arguments, the forward's, the DataLoader's); empty when none can apply."""
    split = split_of(trace)
    facts = _facts(trace)
    loop = facts.get("loop")
    if not isinstance(loop, dict) or isinstance(loop.get("loss"), dict):
        return [split] if split.kind is not None else []
    knobs = loop.get("knobs")
    arguments = _arguments(knobs) if isinstance(knobs, dict) else None
    found: list[Split] = [arguments] if arguments is not None else []
    found.append(AS_BEFORE)
    if loop.get("loader") and not _many(loop.get("accelerate_accumulation")):
        found.append(Split("loader"))
    return found


def output_bytes(trace: Trace | Any, batch: int | None) -> int:
    """Bytes of what the trained model's forward returns besides its loss, at ``batch`` (the measured
    batch): the loop facts' ``outputs`` (docs/trace-format.md), scaled from the batch they were
    measured at (a split forward that returned its last micro-batch's outputs). A split inside the
    forward keeps the earlier micro-batches' (``memdoctor.plan.memory.held_outputs``). 0 where not
    recorded (older traces, a run that died in its first forward)."""
    loop = _facts(trace).get("loop")
    found = loop.get("outputs") if isinstance(loop, dict) else None
    if not isinstance(found, dict):
        return 0
    total, measured = _int(found.get("bytes")), _int(found.get("batch"))
    if total is None:
        return 0
    return total * batch // measured if batch and measured else total


def _facts(trace: Trace | Any) -> dict[str, Any]:
    collected = getattr(trace, "collected", None) or {}
    facts = collected.get("data") if isinstance(collected, dict) else None
    return facts if isinstance(facts, dict) else {}


def planned_split(trace: Trace | Any) -> Split:
    """The split the plan was made with: the one a re-profile used (recorded with its workload: the
    first run may have died before its loss was seen), else the trace's own (``split_of``)."""
    collected = getattr(trace, "collected", None) or {}
    record = collected.get("reprofile") if isinstance(collected, dict) else None
    workload = record.get("workload") if isinstance(record, dict) else None
    return split_from_record(workload.get("split") if isinstance(workload, dict) else None) or split_of(trace)


def split_from_record(d: Any) -> Split | None:
    """The ``Split`` of a workload record's ``split`` (``dataclasses.asdict``); None when not one."""
    if not isinstance(d, dict):
        return None
    try:
        return Split(**d)
    except TypeError:
        return None
