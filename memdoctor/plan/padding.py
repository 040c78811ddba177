"""What the data collector measured about padding, for the padding-policy levers: the padded length,
each batch's longest real sequence, the length percentiles (``Padding``, read by ``padding_facts``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from memdoctor.trace import Trace

PAD_MULTIPLE = 8  # pad_to_multiple_of the planner proposes (tensor cores like multiples of 8)
# Trimming padding to each batch's longest sequence is proposed only where the mean batch gets at least
# this much shorter. Trimmed batches change shape from step to step, and that is not free: on the H200
# a bf16 BERT-base b32 s512 step ran 16% slower trimmed (455 vs 531 samples/s, 2% of the columns
# cut), and a plan near the cap with trimmed batches had allocator-bound steps of up to 2.4 s
# (BENCHMARKS.md, the BERT-base b32 s512 scenario). Below this, the dynamic_padding finding still reports it.
TRIM_MIN_SAVING = 0.10


@dataclass(frozen=True)
class Padding:
    """What the data collector measured about padding, for the padding-policy levers.

    ``padded`` is the padded length every token batch had; ``worst_longest`` the longest real sequence
    of any batch (trimming must plan for it: the long tail, not the mean); ``longest`` every batch's
    longest real sequence (the mean of these sets the time saving); ``percentiles`` the real lengths'
    p90/p99 over all sequences."""

    padded: int
    worst_longest: int
    longest: tuple[int, ...]
    percentiles: dict[str, float]

    def length(self, policy: str, longest: int, multiple: int) -> int:
        """The length one batch is padded to under ``policy`` (never more than as profiled)."""
        cut = longest
        if policy in self.percentiles:
            cut = min(longest, math.ceil(self.percentiles[policy]))
        if multiple > 1:
            cut = -(-cut // multiple) * multiple
        return min(self.padded, max(1, cut))

    def ratio(self, policy: str, multiple: int) -> float:
        """Padded length of the largest batch under ``policy`` / the profiled padded length."""
        return self.length(policy, self.worst_longest, multiple) / self.padded

    def mean_ratio(self, policy: str, multiple: int) -> float:
        return statistics.mean(self.length(policy, n, multiple) for n in self.longest) / self.padded

    def worth_trimming(self) -> bool:
        """Does trimming to the longest save enough to pay for batches that change shape?"""
        return self.mean_ratio("trim", PAD_MULTIPLE) <= 1.0 - TRIM_MIN_SAVING


def padding_facts(trace: Trace, summary: dict[str, Any]) -> tuple[Padding | None, str | None]:
    """The padding levers' measurements, or None with the reason they are unavailable. Every step's
    batches count (warm-up too): the longest batch seen is what a trimmed plan must hold."""
    padded, longest = set(), []
    for step in trace.steps:
        data = step.collectors.get("data")
        batches = data.get("batches") if isinstance(data, dict) else None
        for b in batches if isinstance(batches, list) else []:
            length = _padded_length(b) if isinstance(b, dict) else None
            lengths = b.get("lengths") if length else None
            real = [n for n in lengths if _count(n)] if isinstance(lengths, list) else []
            if length and real:
                padded.add(length)
                longest.append(max(real))
    if not longest:
        return None, "no token batch with real lengths was measured (profile with the data collector)"
    if len(padded) > 1:
        return None, f"batches are already padded to different lengths ({len(padded)} seen): trimmed"
    if min(longest) >= max(padded):
        return None, "every measured batch's longest sequence fills its padded length: nothing to trim"
    pct = ((summary.get("data") or {}).get("lengths")) or {}
    found = {k: float(pct[k]) for k in ("p90", "p99") if isinstance(pct.get(k), (int, float))}
    return Padding(padded.pop(), max(longest), tuple(longest), found), None


def _padded_length(batch: dict[str, Any]) -> int | None:
    """The padded length of a token batch: the second dimension of its batch x length matrix (a trace
    is untrusted input: anything of the wrong type is skipped)."""
    tokens, shapes = batch.get("tokens"), batch.get("shapes")
    if not _count(tokens) or not isinstance(shapes, dict):
        return None
    for shape in shapes.values():
        matrix = isinstance(shape, list) and len(shape) == 2 and all(_count(d) for d in shape)
        if matrix and shape[0] * shape[1] == tokens:
            return int(shape[1])
    return None


def _count(x: Any) -> bool:
    """A positive whole number (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
