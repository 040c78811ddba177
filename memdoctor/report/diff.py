"""``diff.html`` and the text of a diff's figures: ``memdoctor diff``'s comparison (``memdoctor.compare``)
as the terminal table and the page show it."""

from __future__ import annotations

from typing import Any

from memdoctor.report.render import environment
from memdoctor.units import format_bytes
from memdoctor.version import __version__

DIFF_FILENAME = "diff.html"


def format_value(value: Any, unit: str) -> str:
    """A figure of a diff row as text: bytes, milliseconds or a count; ``n/a`` when missing."""
    if value is None:
        return "n/a"
    if unit == "bytes":
        return format_bytes(value)
    if unit == "ms":
        return f"{value:.1f} ms"
    return str(value)


def format_delta(row: dict[str, Any]) -> str:
    """``+1.20 GiB (1.15x)``; ``n/a`` when a side lacks the figure."""
    if row["delta"] is None:
        return "n/a"
    sign = "+" if row["delta"] > 0 else ""
    text = sign + format_value(row["delta"], row["unit"]) if row["unit"] != "bytes" else _signed_bytes(row)
    return f"{text} ({row['ratio']:.2f}x)" if row["ratio"] is not None else text


def _signed_bytes(row: dict[str, Any]) -> str:
    return ("+" if row["delta"] > 0 else "") + format_bytes(row["delta"])


def render_diff_html(data: dict[str, Any]) -> str:
    """``diff.html``: the same base template (and Content-Security-Policy) as the report."""
    env = environment()
    template = env.get_template("diff.html.j2")
    return template.render(
        diff=data,
        fmt=format_value,
        fmt_delta=format_delta,
        memdoctor_version=__version__,
    )
