"""Small number helpers of the summary: medians and optional ints and floats read from a trace."""

from __future__ import annotations

import bisect
import statistics
from typing import Any


def median(values: list[Any]) -> float | None:
    """The median of the values present (None without any), to three decimals: summary.json's
    milliseconds stay readable and stable across platforms."""
    nums = [float(v) for v in values if v is not None]
    return round(statistics.median(nums), 3) if nums else None


def median_of_others(ordered: list[float], value: float) -> float | None:
    """The median of ``ordered`` (sorted ascending) with one ``value`` left out, in O(log n): what
    ``statistics.median`` of "every other step" gives, without sorting again for each step (100,000
    steps would take hours that way)."""
    n = len(ordered) - 1
    if n <= 0:
        return None
    skip = bisect.bisect_left(ordered, value)

    def at(k: int) -> float:
        return ordered[k + 1] if k >= skip else ordered[k]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def opt_int(value: Any) -> int | None:
    """A trace column's value as an int, keeping "not measured" (None) apart from 0."""
    return None if value is None else int(value)


def opt_float(value: Any) -> float | None:
    """A trace column's value as a float, keeping "not measured" (None) apart from 0.0."""
    return None if value is None else float(value)
