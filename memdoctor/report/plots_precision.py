"""The precision section's chart: log2|x| histograms per layer, outputs and gradients side by side.

Each row is a layer, each column a power of two; the colour is the share of the layer's sampled
values in that bin (log colour scale, white where there are none). Dashed lines mark fp16's limits:
2^-24 (below: flushed to zero), 2^-14 (below: subnormal, precision lost) and 2^16 (above: Inf).
"""

from __future__ import annotations

import math
from typing import Any

import matplotlib
from matplotlib.colors import LogNorm

from memdoctor.report.plots import _RC, _figure, _short, svg_data_uri

FP16_LINES = ((-24, "2^-24 flush"), (-14, "2^-14 subnormal"), (16, "65504 max"))
TITLES = {"forward": "module outputs", "backward": "output gradients"}


def histogram_heatmap(chart: dict[str, Any]) -> str | None:
    """Two heatmaps (outputs, gradients) sharing the layer axis; ``None`` when nothing was counted."""
    layers = chart["layers"]
    lo, hi = chart["exponents"]
    lo, hi = min(lo, -26) - 1, max(hi, 17) + 1  # always show fp16's three limits
    grids = {d: _grid(chart[d], lo, hi) for d in ("forward", "backward")}
    if not layers or not any(v == v for g in grids.values() for row in g for v in row):
        return None
    with matplotlib.rc_context(_RC):
        fig = _figure(10.0, 1.8 + 0.22 * len(layers))
        fig.clear()
        axes = fig.subplots(1, 2, sharey=True)
        norm = LogNorm(vmin=1e-4, vmax=1.0)
        image = None
        for ax, (direction, grid) in zip(axes, grids.items(), strict=True):
            image = ax.imshow(
                grid,
                aspect="auto",
                cmap="viridis",
                norm=norm,
                interpolation="nearest",
                extent=(lo - 0.5, hi + 0.5, len(layers) - 0.5, -0.5),
            )
            _fp16_lines(ax)
            ax.set_title(TITLES[direction], fontsize=9)
            ax.set_xlabel("floor(log2 |x|)")
        axes[0].set_yticks(range(len(layers)), [_short(n) for n in layers])
        if image is not None:
            fig.colorbar(image, ax=list(axes), label="share of sampled values", shrink=0.8)
    return svg_data_uri(fig)


def _grid(rows: list[dict[int, float] | None], lo: int, hi: int) -> list[list[float]]:
    """One row per layer, one column per exponent lo..hi; NaN (drawn white) where the count is 0."""
    nan = math.nan
    return [[(row or {}).get(e, 0.0) or nan for e in range(lo, hi + 1)] for row in rows]


def _fp16_lines(ax: Any) -> None:
    for exp, label in FP16_LINES:
        x = exp - 0.5  # column e holds 2^e <= |x| < 2^(e+1): the power of two is its left edge
        ax.axvline(x, color="#b00020", linestyle="--", linewidth=0.9, zorder=4)
        ax.annotate(
            label,
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-2, -2),
            textcoords="offset points",
            rotation=90,
            ha="right",
            va="top",
            fontsize=7,
            color="#b00020",
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85},
        )
