"""Small number helpers of the summary: medians and optional ints and floats read from a trace."""

from __future__ import annotations

import statistics
from typing import Any


def median(values: list[Any]) -> float | None:
    """The median of the values present (None without any), to three decimals: summary.json's
    milliseconds stay readable and stable across platforms."""
    nums = [float(v) for v in values if v is not None]
    return round(statistics.median(nums), 3) if nums else None


def opt_int(value: Any) -> int | None:
    """A trace column's value as an int, keeping "not measured" (None) apart from 0."""
    return None if value is None else int(value)


def opt_float(value: Any) -> float | None:
    """A trace column's value as a float, keeping "not measured" (None) apart from 0.0."""
    return None if value is None else float(value)
