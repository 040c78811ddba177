"""What the commands print on the terminal: the run's summary table and its biggest layers, the plan
and its card table, a diff's tables, the ``Wrote <path>`` lines, and memdoctor's own one-line notes on
stderr. Tables are drawn with rich, imported when first drawn: ``memdoctor --help`` does not load it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memdoctor.cli.arguments import PROG
from memdoctor.units import format_bytes

BUG_LINE = "this is a bug in memdoctor; please report it with the trace"


def say(message: str) -> None:
    """One line of memdoctor's own on stderr (stdout is the tables, or ``plan --json``'s document)."""
    print(f"{PROG}: {message}", file=sys.stderr)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ----------------------------------------------------------------------------------------- profile, report

_TOP_LAYERS = 5


def print_summary(
    summary: dict[str, Any] | None, trace: Any = None, *, status: str | None, message: str | None
) -> None:
    """A short table of the run (from ``summary.json``'s data) and its biggest layers, on stdout."""
    from rich.table import Table

    console = _console()
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    for key, value in _summary_rows(summary or {}, status, message):
        table.add_row(f"[bold]{key}[/bold]", value)
    console.print(table)
    layers = biggest_layers(summary or {}, trace, _TOP_LAYERS)
    if layers:
        console.print(_layers_table(layers, Table))


def _summary_rows(summary: dict[str, Any], status: str | None, message: str | None) -> list[tuple[str, str]]:
    from rich.markup import escape

    device = summary.get("device") or {}
    rows = []
    if device:
        rows.append(("device", escape(_device_text(device))))
    if "steps_profiled" in summary:
        rows.append(("steps profiled", str(summary["steps_profiled"])))
    found = summary.get("steps_found") or {}
    if found.get("by") == "backward" or len(found.get("optimizers") or []) > 1:
        rows.append(("steps found", escape(str(found["how"]))))
    if summary.get("peak_memory_bytes") is not None:
        rows.append(("peak memory", _peak_text(summary)))
    categories = summary.get("categories") or {}
    if categories:
        parts = [
            f"{name.replace('_', ' ')} {format_bytes(v)}" for name, v in categories.items() if v is not None
        ]
        if parts:  # none before a first step: no empty row
            rows.append(("at the peak", ", ".join(parts)))
    precision = summary.get("script_precision") or {}
    if precision.get("text"):
        rows.append(("precision", escape(f"the script {precision['text']}")))
    compiled = summary.get("compiled") or {}
    if compiled.get("text"):
        rows.append(("compiled", escape(str(compiled["text"]))))
    status_text = status or summary.get("status") or "unknown"
    rows.append(("status", escape(f"{status_text}: {message}" if message else status_text)))
    if summary.get("headline"):
        rows.append(("verdict", escape(str(summary["headline"]))))
    return rows


def _device_text(device: dict[str, Any]) -> str:
    name = device.get("name") or device.get("kind") or "unknown"
    text = (
        f"{name}, {format_bytes(device['total_memory_bytes'])}" if device.get("total_memory_bytes") else name
    )
    if device.get("memory_cap_bytes"):
        text += f" (capped to {format_bytes(device['memory_cap_bytes'])} by --budget)"
    return text


def _peak_text(summary: dict[str, Any]) -> str:
    """``1.20 GiB of 8.00 GiB budget (15%)``; the limit is the budget, the cap, or a GPU's memory."""
    peak, device = summary["peak_memory_bytes"], summary.get("device") or {}
    limits = [
        (summary.get("budget_bytes"), "budget"),
        (device.get("memory_cap_bytes"), "cap"),
        (device.get("total_memory_bytes") if device.get("kind") == "cuda" else None, "on the GPU"),
    ]
    limit, label = next(((n, label) for n, label in limits if n), (None, ""))
    if not limit:
        return format_bytes(peak)
    return f"{format_bytes(peak)} of {format_bytes(limit)} {label} ({100 * peak / limit:.0f}%)"


def biggest_layers(summary: dict[str, Any], trace: Any, n: int) -> list[dict[str, Any]]:
    """The ``n`` holders of the most activation bytes, at any depth: layers (submodules included), a
    module's own code, and code outside every child module (a model's own forward code, the loop's
    loss: ``summary["outside_modules"]``), by the line that allocated it.

    With the trace, the layers are the report's bar chart's (the model opened down to its repeated
    blocks: ``encoder.layer.0`` ... rather than ``bert`` or single ``Linear`` layers), with the "(own)"
    bars of the modules passed on the way down; without it, every module of the summary except the roots.
    A root's own code is shown by line where the trace has those lines, else as one "(own code)" row.
    """
    rows = {row.get("name"): row for row in summary.get("layers") or []}
    outside = [_outside_row(h) for h in summary.get("outside_modules") or []]
    by_line = {h.get("model") for h in summary.get("outside_modules") or [] if h.get("holder") == "root"}
    candidates = [row for row in rows.values() if row.get("depth", 1) and row.get("name")]
    if trace is not None and trace.models:
        from memdoctor.analysis import peak_step, top_layers  # loads the analysis on first use

        bars = top_layers(trace, peak_step(trace), limit=len(rows) + 1)
        candidates = [_bar_row(bar, rows, by_line) for bar in bars]
    candidates = [row for row in candidates + outside if row and (row.get("activation_bytes") or 0) > 0]
    return sorted(candidates, key=lambda row: -(row.get("activation_bytes") or 0))[:n]


def _bar_row(bar: dict[str, Any], rows: dict[Any, dict[str, Any]], by_line: set[Any]) -> dict[str, Any]:
    """A bar of the chart as a table row; a root's "(own)" bar is its own code: named so, and left out
    where the outside-module rows show it line by line (empty)."""
    name = bar["name"]
    own = bar.get("own") and name.endswith(" (own)")
    row = rows.get(name[: -len(" (own)")] if own else name, {})
    if own:
        if row.get("depth") == 0:
            if row.get("model") in by_line:
                return {}
            name = name[: -len(" (own)")] + " (own code)"
        row = {k: v for k, v in row.items() if k not in ("forward_ms", "backward_ms")}  # a subtree's
    return {
        **row,
        "name": name,
        "type": bar.get("type"),
        "activation_bytes": bar.get("activations"),
        "param_bytes": bar.get("parameters"),
    }


def _outside_row(holder: dict[str, Any]) -> dict[str, Any]:
    """A holder outside every child module as a table row: its name and line; its saved activations and
    the peak ledger's temporaries from that line together."""
    return {
        "name": f"{holder.get('name')} at {holder.get('site')}",
        "type": "",
        "activation_bytes": sum(int(holder.get(k) or 0) for k in ("activation_bytes", "temporary_bytes")),
        "param_bytes": 0,
    }


def _layers_table(layers: list[dict[str, Any]], table_cls: Any) -> Any:
    from rich import box
    from rich.markup import escape

    longest = max(len(str(layer.get("name"))) for layer in layers)
    table = table_cls(
        title="biggest memory holders by activation memory (layers, own code, the loop)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Names wrap, never get cut: they are what the user acts on; the type column gives way first.
    table.add_column("holder", overflow="fold", min_width=min(longest, 40))
    table.add_column("type", overflow="ellipsis", max_width=14)
    for col in ("activations", "parameters", "fwd / bwd ms"):
        table.add_column(col, justify="right")
    for layer in layers:
        table.add_row(
            escape(str(layer.get("name"))),
            escape(str(layer.get("type") or "")),
            format_bytes(layer.get("activation_bytes")),
            format_bytes(layer.get("param_bytes")),
            f"{_ms(layer.get('forward_ms'))} / {_ms(layer.get('backward_ms'))}",
        )
    return table


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_written(paths: Sequence[Path | str | None]) -> None:
    """``Wrote <path>`` for each file that is there (a run cut short writes fewer than it would)."""
    for path in paths:
        if path is not None and Path(path).exists():
            print(f"Wrote {path}")


# ----------------------------------------------------------------------------------------- plan


def print_plan(out: dict[str, Any], cards: list[dict[str, Any]]) -> None:
    """The plan in a few lines, the findings and the card table, on stdout."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    plan = out["plan"]
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    for key, value in _plan_rows(plan):
        table.add_row(f"[bold]{key}[/bold]", escape(value))
    console.print(table)
    for line in plan["advice"]:
        console.print(escape(f"- {line}"))
    for f in out["findings"]:
        console.print(escape(f"finding [{f['severity']}] {f['rule']}: {f['title']}: {f['evidence']}"))
    console.print(_cards_table(cards, Table))


def _plan_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    where = f" ({plan['card']})" if plan["card"] else ""
    margin = f"{format_bytes(plan['limit_bytes'])} after a {plan['safety_margin']:.0%} margin"
    ratio = plan["predicted_step_time_ratio"]
    rows = [
        ("budget", f"{format_bytes(plan['budget_bytes'])}{where}, {margin}"),
        ("planned from", plan.get("planned_peak") or format_bytes(plan["measured_peak_bytes"])),
    ]
    if plan["fits_as_is"]:
        verdict = "fits as it is"
    elif plan["fits"]:
        verdict = "fits with: " + "; ".join(plan["levers"])
    else:
        verdict = "nothing modelled fits"
    rows.append(("plan", verdict))
    if plan.get("script_precision"):
        rows.append(("precision", f"kept as the script's: it {plan['script_precision']}"))
    rows.append(("predicted peak", f"{format_bytes(plan['predicted_reserved_bytes'])} reserved"))
    rows.append(("step time", "unknown from this trace" if ratio is None else f"x{ratio:.2f} (predicted)"))
    if plan["config"]["checkpoint"]:
        rows.append(("checkpoint", ", ".join(plan["config"]["checkpoint"])))
    return rows


def _cards_table(cards: list[dict[str, Any]], table_cls: Any) -> Any:
    from rich import box
    from rich.markup import escape

    table = table_cls(
        title="which cards, and how many", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for col, justify in (("card", "left"), ("memory", "right"), ("verdict", "left"), ("predicted", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    table.add_column("step time", justify="right")
    for c in cards:
        verdict = c["verdict"] + (": " + "; ".join(c["levers"]) if c["levers"] else "")
        if c.get("gpus", 1) > 1:
            verdict = f"{c['gpus']} cards: {verdict}"
        needed = c.get("gpus_needed")
        if needed:
            verdict += f"; {needed['gpus']} cards fit: " + "; ".join(needed["levers"])
        ratio = c["predicted_step_time_ratio"]
        table.add_row(
            escape(c["card"]),
            format_bytes(c["memory_bytes"]),
            escape(verdict),
            format_bytes(c["predicted_reserved_bytes"]),
            "unknown" if ratio is None else f"x{ratio:.2f}",
        )
    return table


# ----------------------------------------------------------------------------------------- diff


def print_diff(data: dict[str, Any]) -> None:
    """The comparison as terminal tables: headline figures, categories, most-changed layers."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from memdoctor.report.diff import format_delta, format_value

    console = _console()
    console.print(f"A: {escape(data['a']['path'])}\nB: {escape(data['b']['path'])}")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("", "A", "B", "B - A"):
        table.add_column(col, justify="left" if not col else "right")
    for row in [*data["rows"], *data["categories"]]:
        a, b = format_value(row["a"], row["unit"]), format_value(row["b"], row["unit"])
        table.add_row(escape(row["label"]), a, b, format_delta(row))
    console.print(table)
    if data["layers"]:
        layers = Table(title="layers whose memory changed most", title_justify="left", box=box.SIMPLE_HEAD)
        longest = max(len(row["name"]) for row in data["layers"])
        layers.add_column("layer", overflow="fold", min_width=min(longest, 40))
        for col in ("activations A", "activations B", "parameters A", "parameters B"):
            layers.add_column(col, justify="right")
        for row in data["layers"]:
            vals = (row["activation_a"], row["activation_b"], row["param_a"], row["param_b"])
            layers.add_row(escape(row["name"]), *("-" if v is None else format_bytes(v) for v in vals))
        console.print(layers)


def _console() -> Any:
    """rich's console, but a closed stdout pipe (``memdoctor report ... | head``) is the reader's choice,
    not a failure: rich would exit 1 there; ``BrokenPipeError`` reaches the command line's edge, which
    answers 0 (``memdoctor.cli``)."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return PipeConsole(highlight=False)
