"""The report's charts, drawn with matplotlib's object API (``Figure``, never ``pyplot``).

Each function takes plot-ready data from ``memdoctor.analysis`` and returns a ``data:image/svg+xml``
URI, so the HTML stays one self-contained file and any text inside the SVG (module names) is inert in an
``<img>``. Output is deterministic: a fixed ``svg.hashsalt`` and no date in the metadata. rc settings are
applied with ``rc_context``, so a user's matplotlib configuration is left as it was.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from memdoctor.analysis.layers import ENGINE_CATEGORIES
from memdoctor.units import format_bytes

COLORS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_state": "#59a14f",
    "activations": "#e15759",
    "other": "#bab0ac",
    "gradient_buckets": "#edc948",
    "sharding_buffers": "#b07aa1",
}
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other": "other",
    "gradient_buckets": "DDP gradient buckets",
    "sharding_buffers": "FSDP2 buffers",
}
PHASE_COLORS = {"forward": "#e8f0fa", "backward": "#fdf0e3", "optimizer": "#eaf5e8"}
STACK = ("parameters", "gradients", "optimizer_state", "activations")
_RC: dict[Any, Any] = {
    "svg.hashsalt": "memdoctor",
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
MAX_LABEL = 44


def svg_data_uri(fig: Figure) -> str:
    """Render ``fig`` as SVG and wrap it in a base64 data URI."""
    buf = io.BytesIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "memdoctor"})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def byte_unit(largest: float) -> tuple[float, str]:
    """The binary unit the axis is labelled in, chosen so the largest value reads below 1024."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return float(1024**power), unit
    return 1.0, "B"


def _short(name: str) -> str:
    return name if len(name) <= MAX_LABEL else "…" + name[-(MAX_LABEL - 1) :]


def _figure(width: float, height: float) -> Figure:
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(width, height), layout="constrained")
        fig.add_subplot()
    return fig


def layer_bars(
    bars: list[dict[str, Any]],
    activations_live: bool = True,
    unreached: str = "not reached",
    died_in: str | None = None,
) -> str | None:
    """Horizontal stacked bars per top-level layer (first layer on top); ``None`` without bars.

    A layer that never ran in the step (``ran`` False) is labelled ``unreached`` beside its bar: drawn
    as a bare zero it would read as a cheap layer when the run died before measuring it. With
    ``activations_live`` False (the peak came when no activations were held: the optimizer step) the
    activations are hatched and labelled as freed before the peak, so the bars show what the peak held.
    ``died_in``: the module the run died in; the layer holding it is marked so, partly measured."""
    if not bars:
        return None
    scale, unit = byte_unit(max(max(b["total"] for b in bars), 1))
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 1.3 + 0.28 * len(bars))
        ax = fig.axes[0]
        y = list(range(len(bars)))
        left = [0.0] * len(bars)
        for cat in STACK:
            width = [b[cat] / scale for b in bars]
            style: dict[str, Any] = {"color": COLORS[cat], "label": LABELS[cat]}
            if cat == "activations" and not activations_live:
                style = {"color": "none", "edgecolor": COLORS[cat], "hatch": "////", "linewidth": 0.6}
                style["label"] = "activations (saved in the forward, freed before the peak)"
            ax.barh(y, width, left=left, height=0.72, **style)
            left = [a + w for a, w in zip(left, width, strict=True)]
        for i, b in enumerate(bars):
            name = str(b["name"]).removesuffix(" (own)")
            held = died_in is not None and (died_in == name or died_in.startswith(name + "."))
            note = "died in it (measured until then)" if held else None if b.get("ran", True) else unreached
            if note:
                ax.annotate(
                    note,
                    (left[i], i),
                    xytext=(4, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                    color="#b00020" if held else "#6b6b70",
                    fontstyle="italic",
                )
        ax.set_yticks(y, [_short(b["name"]) for b in bars])
        ax.invert_yaxis()
        ax.set_xlabel(f"memory ({unit}) at the peak step")
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.legend(
            loc="lower right", frameon=False, ncols=4 if activations_live else 2, bbox_to_anchor=(1.0, 1.0)
        )
    return svg_data_uri(fig)


def timeline(series: dict[str, Any], limit: int | None = None, limit_label: str = "budget") -> str | None:
    """Memory through one step: categories stacked, allocator lines, phases shaded, the peak marked."""
    t = series["t_ms"]
    if len(t) < 2:
        return None
    # A limit far above the step's memory (an H200's 140 GiB under a 10 GiB step) would flatten the
    # plot: it is then named in a corner instead of drawn.
    far = bool(limit) and limit_off_scale(series, limit)  # type: ignore[arg-type]
    top = _timeline_top(series, None if far else limit)
    scale, unit = byte_unit(top)
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 3.8)
        ax = fig.axes[0]
        _shade_phases(ax, series["phases"])
        _stack(ax, t, series["categories"], scale)
        _allocator_lines(ax, t, series["allocator"], scale)
        _mark_peak(ax, series, scale)
        if limit and far:
            ax.annotate(
                f"{limit_label} {format_bytes(limit)}: off the scale",
                (0.0, 1.0),
                xycoords="axes fraction",
                xytext=(4, -12),
                textcoords="offset points",
                ha="left",
                color="#b00020",
                fontsize=8,
            )
        elif limit:
            ax.axhline(limit / scale, color="#b00020", linestyle="--", linewidth=1.2)
            ax.annotate(
                f"{limit_label} {format_bytes(limit)}",
                (t[0], limit / scale),
                color="#b00020",
                xytext=(2, 3),
                textcoords="offset points",
                fontsize=8,
            )
        ax.set_xlim(t[0], t[-1])
        ax.set_ylim(0, top * 1.08 / scale)
        ax.set_xlabel("time since step start (ms)")
        ax.set_ylabel(f"memory ({unit})")
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncols=4)
    return svg_data_uri(fig)


TIMELINE_POINTS = 1000  # more samples than this are thinned before drawing (a path per sample in the SVG)


def thin_series(series: dict[str, Any], limit: int = TIMELINE_POINTS) -> dict[str, Any]:
    """``series`` with at most about ``limit`` samples: of every ``k`` consecutive samples the one with the
    largest stacked total, so the envelope and the peak survive; ``thinned`` is ``k`` (1: untouched)."""
    t = series["t_ms"]
    k = -(-len(t) // limit)
    if k <= 1:
        return {**series, "thinned": 1}
    totals = [sum(vals) for vals in zip(*series["categories"].values(), strict=True)]
    keep = sorted(
        {0, len(t) - 1}
        | {max(range(i, min(i + k, len(t))), key=totals.__getitem__) for i in range(0, len(t), k)}
    )
    return {
        **series,
        "t_ms": [t[i] for i in keep],
        "categories": {c: [v[i] for i in keep] for c, v in series["categories"].items()},
        "allocator": {c: [v[i] for i in keep] for c, v in series["allocator"].items()},
        "thinned": k,
    }


LIMIT_OFF_SCALE = 3.0  # a limit more than this many times the step's top is named, not drawn


def limit_off_scale(series: dict[str, Any], limit: int) -> bool:
    """Whether ``limit`` is so far above the step's memory that drawing it would flatten the plot."""
    return limit > LIMIT_OFF_SCALE * _timeline_top(series, None)


def _timeline_top(series: dict[str, Any], limit: int | None) -> float:
    stacked = [sum(vals) for vals in zip(*series["categories"].values(), strict=False)]
    lines = [v for col in series["allocator"].values() for v in col if v is not None]
    return float(max([*stacked, *lines, series.get("peak_bytes") or 0, limit or 0, 1]))


def _shade_phases(ax: Any, spans: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for span in spans:
        color = PHASE_COLORS.get(span["phase"])
        if color is None or span["end_ms"] <= span["start_ms"]:
            continue
        label = None if span["phase"] in seen else span["phase"]
        seen.add(span["phase"])
        ax.axvspan(span["start_ms"], span["end_ms"], color=color, linewidth=0, label=label, zorder=0)


def _stack(ax: Any, t: list[float], categories: dict[str, list[int]], scale: float) -> None:
    base = [0.0] * len(t)
    engines = [c for c in ENGINE_CATEGORIES if c in categories]  # a DDP or FSDP2 rank's
    for cat in (*STACK, *engines):
        top = [b + v / scale for b, v in zip(base, categories[cat], strict=False)]
        ax.fill_between(t, base, top, step="post", color=COLORS[cat], label=LABELS[cat], linewidth=0)
        base = top


def _allocator_lines(ax: Any, t: list[float], allocator: dict[str, list[Any]], scale: float) -> None:
    styles = {"allocated": ("#222222", "-"), "reserved": ("#777777", ":")}
    for name, col in allocator.items():
        color, style = styles.get(name, ("#444444", "-"))
        y = [float("nan") if v is None else v / scale for v in col]
        ax.step(t, y, where="post", color=color, linestyle=style, linewidth=1.1, label=f"{name} (allocator)")


def _mark_peak(ax: Any, series: dict[str, Any], scale: float) -> None:
    peak, at = series.get("peak_bytes"), series.get("peak_t_ms")
    if not peak or at is None:
        return
    ax.plot([at], [peak / scale], marker="v", color="#000000", markersize=7, linestyle="none")
    ax.annotate(
        f"peak {format_bytes(peak)}",
        (at, peak / scale),
        xytext=(6, 4),
        textcoords="offset points",
        fontsize=8,
        fontweight="bold",
    )


def grad_norms(chart: dict[str, Any] | None) -> str | None:
    """Gradient norm per layer (first layer on top), one line per step, log scale; ``None`` when there
    is nothing positive to draw (a zero, NaN or missing norm leaves a gap)."""
    if not chart or not chart["layers"]:
        return None
    series = [[v if v is not None and v > 0 else float("nan") for v in st["norms"]] for st in chart["steps"]]
    if not any(v == v for values in series for v in values):
        return None
    layers = chart["layers"]
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 1.5 + 0.26 * len(layers))
        ax = fig.axes[0]
        y = list(range(len(layers)))
        colors = matplotlib.colormaps["viridis"]
        for k, (st, x) in enumerate(zip(chart["steps"], series, strict=True)):
            color = colors(k / max(1, len(series) - 1) * 0.85)
            label = f"step {st['step']}" + (" (warm-up)" if st["warmup"] else "")
            ax.plot(x, y, marker="o", markersize=3.5, linewidth=0.9, color=color, label=label)
        ax.set_xscale("log")
        ax.set_yticks(y, [_short(n) for n in layers])
        ax.invert_yaxis()
        ax.set_xlabel("gradient L2 norm (log scale)")
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.legend(loc="lower right", frameon=False, ncols=4, bbox_to_anchor=(1.0, 1.0))
    return svg_data_uri(fig)
