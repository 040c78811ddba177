"""Small number helpers of the summary: medians and optional ints and floats read from a trace."""

from __future__ import annotations

import statistics
from typing import Any


def median(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if v is not None]
    return round(statistics.median(nums), 3) if nums else None


def opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
