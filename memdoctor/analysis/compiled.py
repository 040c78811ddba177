"""What ``torch.compile`` did in the profiled run, and what that means for the figures.

Reads the run-wide ``compile`` collector record (``memdoctor.capture.compiled``): graphs dynamo made,
frames it saw and compiled, graph breaks by reason. ``summarize`` adds ``compiled`` to
``summary.json`` (null when nothing was compiled, or in traces from before the record): the figures and
one ``text`` line the terminal and the report show. memdoctor's hooks stay out of compiled code, so a
compiled region counts as one call of the module that called it; graph breaks come from the script's
code or from torch's, and each one runs the code around it eagerly, which makes steps slower.
"""

from __future__ import annotations

from typing import Any

from memdoctor.trace import Trace

NAME = "compile"
COUNTS = ("graphs", "frames", "frames_compiled", "graph_breaks")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _reasons(value: Any) -> list[dict[str, Any]]:
    out = []
    for r in value if isinstance(value, list) else []:
        if isinstance(r, dict) and isinstance(r.get("reason"), str) and _count(r.get("count")) is not None:
            out.append({"reason": r["reason"], "count": r["count"]})
    return out


def compile_figures(trace: Trace) -> dict[str, Any] | None:
    """The ``compiled`` summary object, or None when the trace has no usable ``compile`` record."""
    data = trace.collected.get(NAME)
    if not isinstance(data, dict):
        return None
    counts = {k: _count(data.get(k)) for k in COUNTS}
    if any(v is None for v in counts.values()):
        return None
    ours = _count(data.get("memdoctor_breaks")) or 0  # optional: absent in the first traces with it
    out: dict[str, Any] = {
        **counts,
        "memdoctor_breaks": min(ours, counts["graph_breaks"] or 0),
        "break_reasons": _reasons(data.get("break_reasons")),
    }
    out["text"] = compile_text(out)
    return out


def compile_text(c: dict[str, Any]) -> str:
    """One line: whether the model ran compiled, its graph breaks, and what they do to the figures."""
    graphs, breaks = c["graphs"], c["graph_breaks"]
    eager = max(0, c["frames"] - c["frames_compiled"])
    if not graphs:
        return (
            f"torch.compile compiled nothing: dynamo ran all {c['frames']} frames it saw in eager "
            "PyTorch, so step times and per-layer figures are those of the eager model"
        )
    where = (
        "memdoctor's hooks stay out of compiled code, so a compiled region counts as one call of the "
        "module that called it (its activations, time and FLOPs are that module's, not per layer; "
        "FLOPs run by fused kernels may be missed) and the first step includes compiling"
    )
    if not breaks:
        return f"the model ran compiled (torch.compile, {graphs} graph(s), no graph break); {where}"
    top = c["break_reasons"][0]["reason"] if c["break_reasons"] else "unknown"
    fell_back = f"; {eager} frame(s) ran wholly eager" if eager else ""
    ours = c["memdoctor_breaks"]
    whose = (
        f"{ours} of them at memdoctor's optimizer-step hooks, which a compiled optimizer.step() calls and "
        "which run eagerly so that steps are found; the rest the script's or torch's"
        if ours
        else "none from memdoctor's hooks"
    )
    without = "" if ours else ", as they are without memdoctor"
    return (
        f"the model ran compiled with {breaks} graph break(s) ({graphs} graph(s){fell_back}; {whose}; "
        f"most frequent: {top}): the code at each break runs in eager PyTorch between compiled graphs, so "
        f"steps are slower than one whole graph would be{without}; {where}"
    )


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """Add ``compiled`` (null when the run compiled nothing, or the trace predates the record)."""
    summary["compiled"] = compile_figures(trace)
