"""The layer x time memory heatmap: rows are layers in model order, columns time through the step, colour
the saved activations a layer holds (``memdoctor.analysis.heatmap`` says how they are attributed)."""

from __future__ import annotations

from typing import Any

import matplotlib

from memdoctor.report.plots import _RC, _figure, _short, byte_unit, svg_data_uri

CMAP = "YlOrRd"
PHASE_LINE = "#6b6b70"


def layer_heatmap(hm: dict[str, Any] | None) -> str | None:
    """The heatmap as an SVG data URI (the grid itself a raster inside it); ``None`` without data."""
    if not hm or not hm["rows"]:
        return None
    scale, unit = byte_unit(hm["max_bytes"])
    rows = len(hm["rows"])
    extent = (hm["t0_ms"], hm["t1_ms"], rows, 0)
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 1.6 + 0.2 * rows)
        ax = fig.axes[0]
        grid = [[v / scale for v in row] for row in hm["values"]]
        cmap = matplotlib.colormaps[CMAP].with_extremes(under="#ffffff")
        low = 0.5 / scale  # below one byte: drawn white, as "holds nothing"
        image = ax.imshow(grid, aspect="auto", interpolation="none", cmap=cmap, vmin=low, extent=extent)
        ax.set_yticks([r + 0.5 for r in range(rows)], [_short(n) for n in hm["rows"]], fontsize=7.5)
        _phase_marks(ax, hm)
        ax.set_xlabel("time since step start (ms)")
        bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.01)
        bar.set_label(f"saved activations held ({unit})")
    return svg_data_uri(fig)


def _phase_marks(ax: Any, hm: dict[str, Any]) -> None:
    """A thin line where each phase begins, named above the plot; a dashed line at the step's peak."""
    for span in hm["phases"]:
        if span["phase"] not in ("forward", "backward", "optimizer") or span["end_ms"] <= span["start_ms"]:
            continue
        ax.axvline(span["start_ms"], color=PHASE_LINE, linewidth=0.7)
        ax.annotate(
            span["phase"],
            (span["start_ms"], 0),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=7,
            color=PHASE_LINE,
            annotation_clip=False,
        )
    peak = hm.get("peak_t_ms")
    if peak is not None and hm["t0_ms"] <= peak <= hm["t1_ms"]:
        ax.axvline(peak, color="#000000", linestyle="--", linewidth=1.0)
        ax.annotate(
            "peak", (peak, 0), xytext=(2, 12), textcoords="offset points", fontsize=7, annotation_clip=False
        )
