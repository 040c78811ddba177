"""The compute section's chart: where each module's own work sits between memory- and compute-bound."""

from __future__ import annotations

import math
from typing import Any

import matplotlib

from memdoctor.report.plots import _RC, _figure, svg_data_uri

LABELLED = 6  # the modules with most FLOPs get their name next to their point


def intensity_scatter(
    modules: list[dict[str, Any]], ridge: float | None, step_intensity: float | None
) -> str | None:
    """Log-log scatter: a module's own arithmetic intensity (x) against its own FLOPs (y), with the
    device's ridge point and the step's intensity as vertical lines; ``None`` with nothing to draw."""
    points = [m for m in modules if m.get("own_intensity") and m.get("own_flops")]
    if not points:
        return None
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 4.2)
        ax = fig.axes[0]
        ax.scatter(
            [m["own_intensity"] for m in points],
            [m["own_flops"] for m in points],
            s=18,
            color="#4e79a7",
            alpha=0.75,
            edgecolors="none",
        )
        if ridge:
            ax.axvline(
                ridge, color="#e15759", linestyle="--", linewidth=1.0, label=f"ridge point {ridge:.3g}"
            )
        if step_intensity:
            ax.axvline(
                step_intensity,
                color="#59a14f",
                linestyle=":",
                linewidth=1.2,
                label=f"whole step {step_intensity:.3g}",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        _label(ax, points)
        ax.set_xlabel("arithmetic intensity, FLOP per byte moved (log; bytes unfused, so a lower bound)")
        ax.set_ylabel("FLOPs, forward + backward (log)")
        ax.grid(color="#dddddd", linewidth=0.6)
        if ridge or step_intensity:
            ax.legend(loc="upper left", frameon=False)
    return svg_data_uri(fig)


def _label(ax: Any, points: list[dict[str, Any]]) -> None:
    """Name the points with most FLOPs, once per position (the blocks of a repeated stack sit on one
    point: the first block names it), by the last two parts of their names, kept inside the axes."""
    lo, hi = (math.log10(v) for v in ax.get_xlim())
    seen: set[tuple[float, float]] = set()
    for m in points:
        x, y = m["own_intensity"], m["own_flops"]
        where = (round(math.log10(x), 2), round(math.log10(y), 2))
        if where in seen:
            continue
        seen.add(where)
        right = (math.log10(x) - lo) / ((hi - lo) or 1.0) > 0.6
        ax.annotate(
            ".".join(m["name"].split(".")[-2:]),
            (x, y),
            xytext=(-4 if right else 4, 3 if len(seen) % 2 else -9),  # alternate: neighbours apart
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=7,
            color="#444444",
        )
        if len(seen) >= LABELLED:
            return
