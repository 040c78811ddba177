"""The data section's charts: data-loader wait against step time, and the sequence-length histogram.

Same conventions as ``memdoctor.report.plots`` (matplotlib's object API, deterministic SVG data URIs).
"""

from __future__ import annotations

from typing import Any

import matplotlib

from memdoctor.report.plots import _RC, _figure, svg_data_uri

STEP_COLOR = "#d5dde8"
WAIT_COLOR = "#f28e2b"
IDLE_COLOR = "#b00020"
LENGTH_COLOR = "#4e79a7"
MAX_BINS = 40


def wait_chart(rows: list[dict[str, Any]]) -> str | None:
    """One bar per profiled step: its duration, the loop's data-loader wait over it and, where measured,
    the part of the wait the device sat idle. None without a step that has both figures."""
    rows = [r for r in rows if r.get("duration_ms") and r.get("wait_ms") is not None]
    if not rows:
        return None
    x = list(range(len(rows)))
    idle = [r.get("device_wait_ms") for r in rows]
    measured_idle = [float(v) for v in idle if v is not None]
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 2.8)
        ax = fig.axes[0]
        ax.bar(x, [r["duration_ms"] for r in rows], width=0.8, color=STEP_COLOR, label="step time")
        ax.bar(x, [r["wait_ms"] for r in rows], width=0.56, color=WAIT_COLOR, label="waiting for data")
        if len(measured_idle) == len(rows):
            ax.bar(x, measured_idle, width=0.3, color=IDLE_COLOR, label="device idle while waiting")
        ax.set_xticks(x, [str(r["step"]) for r in rows])
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncols=3)
    return svg_data_uri(fig)


def length_histogram(lengths: list[int], padded: list[int], stats: dict[str, Any] | None) -> str | None:
    """Histogram of the real sequence lengths, with p50/p90/max and the padded length(s) marked."""
    if not lengths or stats is None:
        return None
    top = max([*lengths, *padded])
    width = max(1, -(-(top + 1) // MAX_BINS))  # integer bins, at most MAX_BINS of them
    edges = [e - 0.5 for e in range(0, top + width + 1, width)]  # integer lengths centred in bins
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 2.8)
        ax = fig.axes[0]
        ax.hist(lengths, bins=edges, color=LENGTH_COLOR, edgecolor="white", linewidth=0.4)
        for key, style in (("p50", ":"), ("p90", "--"), ("max", "-")):
            ax.axvline(
                stats[key], color="#333333", linestyle=style, linewidth=1.0, label=f"{key} {stats[key]:g}"
            )
        for i, p in enumerate(padded[:4]):
            label = "padded to " + ", ".join(map(str, padded[:4])) if i == 0 else None
            ax.axvline(p, color=IDLE_COLOR, linestyle="--", linewidth=1.2, label=label)
        ax.set_xlabel("real sequence length (tokens)")
        ax.set_ylabel("sequences")
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncols=4)
    return svg_data_uri(fig)
