"""Which micro-batch split ``memdoctor run`` can apply to this script, known before it is proposed.

Read from the data collector's ``loop`` facts (docs/trace-format.md), in the order an expert would try:

1. ``forward``: the trained model's forward returns its loss (a tensor, a tuple's element, a ``loss``
   key or attribute): split inside the forward (``memdoctor.levers.microbatch``).
2. ``loader``: the loop computes the loss, its training batches come from a DataLoader read without
   look-ahead, and a ``torch.optim`` optimizer steps: split each batch at the loader and defer the
   step (``memdoctor.levers.loopsplit``).
3. ``arguments``: the script parses a batch-size and a gradient-accumulation argument: pass smaller
   batches and more accumulation steps, the effective batch unchanged (``memdoctor.levers.scriptargs``).

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
        return [self.batch_option, str(self.batch_value // k), self.accumulation_option, str(steps)]


AS_BEFORE = Split("forward")


def split_of(trace: Trace | Any) -> Split:
    """The split the trace's loop facts allow (module docstring)."""
    collected = getattr(trace, "collected", None) or {}
    facts = collected.get("data") if isinstance(collected, dict) else None
    loop = facts.get("loop") if isinstance(facts, dict) else None
    if not isinstance(loop, dict):
        return AS_BEFORE
    loss = loop.get("loss")
    if not isinstance(loss, dict) or loss.get("in_forward"):
        return AS_BEFORE  # no training forward seen (a run that died first): as before
    lookahead = facts.get("lookahead") if isinstance(facts, dict) else None
    if loop.get("loader") and loop.get("torch_optim") and not lookahead:
        return Split("loader")
    found = loop.get("knobs")
    knobs: dict[str, Any] = found if isinstance(found, dict) else {}
    if knobs.get("batch_option") and knobs.get("accumulation_option") and _int(knobs.get("batch_value")):
        return Split(
            "arguments",
            batch_option=str(knobs["batch_option"]),
            batch_value=_int(knobs.get("batch_value")),
            accumulation_option=str(knobs["accumulation_option"]),
            accumulation_value=_int(knobs.get("accumulation_value")) or 1,
        )
    return Split(None, _why_not(loss, loop, lookahead, knobs))


def _why_not(loss: dict[str, Any], loop: dict[str, Any], lookahead: Any, knobs: dict[str, Any]) -> str:
    where = loss.get("why") or "the loop computes the loss"
    if loop.get("loader") and not loop.get("torch_optim"):
        source = "batches come from a DataLoader but no torch.optim optimizer steps (whose step could wait)"
    elif loop.get("loader"):
        source = f"the DataLoader is read {lookahead} batch(es) ahead (accelerate), so a split cannot align"
    else:
        source = "batches do not come from a DataLoader"
    if knobs.get("batch_option"):
        args = f"the script has a batch-size argument ({knobs['batch_option']}) but no accumulation argument"
    else:
        args = "the script has no batch-size and accumulation arguments (argparse)"
    return f"no safe micro-batch split: {where}; {source}; {args}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
