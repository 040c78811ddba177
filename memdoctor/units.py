"""Byte sizes: parsing what users type (``8GiB``, ``7.5GB``, ``512M``) and formatting what we show; and
short listings of names (``first_names``)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from memdoctor.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
# The longest name (a module's qualified name, a class name) a trace records and a reader accepts.
MAX_NAME_CHARS = 4096
# The largest size memdoctor takes (1 EiB): anything past it is a typo, and would overflow the figures.
MAX_SIZE_BYTES = 1024**6
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a byte size such as ``8GiB``, ``8G`` (binary), ``7.5GB`` (decimal) or ``123456``."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UsageError(f"cannot read {text!r} as a size: write e.g. 8GiB, 7.5GB, 512MiB or a byte count")
    value = float(match.group(1)) * _UNITS[unit]
    if not value <= MAX_SIZE_BYTES:  # also inf, from hundreds of digits
        raise UsageError(f"{_cut(text)!r} is larger than memdoctor takes (at most 1 EiB); check the size")
    if int(value) <= 0:
        raise UsageError(f"a size must be positive, got {text!r}")
    return int(value)


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def fit_name(name: str, limit: int = MAX_NAME_CHARS) -> str:
    """``name`` as a trace records it: unchanged up to ``limit`` characters, else its start, ``~`` and 16
    hex digits of its SHA-256. The same name is cut the same way everywhere (the trace, the plan, the
    config, and ``memdoctor run`` finding a config's modules in the live model), and two long names
    that share their start stay apart."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{name[: limit - 17]}~{digest}"


def format_bytes(n: float | int | None, precision: int = 2) -> str:
    """Format a byte count with binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def first_names(texts: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``texts`` joined by ``sep``, then " and N more" for the rest."""
    more = f" and {len(texts) - limit} more" if len(texts) > limit else ""
    return sep.join(texts[:limit]) + more


# How much of an exception's message an event keeps, and of a collector's failure note: the trace's
# events are bounded so that a pathological message cannot bloat it.
MESSAGE_CHARS = 500
NOTE_CHARS = 400


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, ending in "…" where it was cut
    (a cut mid-word reads as a typo, and "Memory Ma" loses the word the reader would search for)."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[: cut if cut > limit // 2 else limit - 1].rstrip() + "…"
