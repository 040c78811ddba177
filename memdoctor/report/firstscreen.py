"""The report's first screen: the three answers a reader wants before scrolling.

Does it fit (the verdict, in the success colour only when it does), what ate the memory (the layers
and code lines holding the most bytes at the peak, not only a category), and what to type (one
command that works from any folder, and whether the plan was measured or only predicted). The
sections below the first screen give the evidence; this module only picks and words the answers.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from memdoctor.analysis.layers import TOP_LAYERS, outside_holders, top_layers
from memdoctor.analysis.steps import peak_step
from memdoctor.analysis.verified import chosen_round, rounds_with_error
from memdoctor.trace import Trace

TOP_EATERS = 5  # layers listed under "what ate the memory"
TOP_LINES = 3  # code lines listed beside them
# A code line is listed when it holds at least this share of the peak (a 4-byte loss scalar is not news).
LINE_MIN_SHARE = 0.02


def first_screen(trace: Trace, summary: dict[str, Any], config_path: str) -> dict[str, Any]:
    """``{verdict, eaters, lines, command}`` for the top of the report."""
    return {
        "verdict": verdict(trace, summary),
        "eaters": eaters(trace),
        "lines": code_lines(trace, summary),
        "command": command(trace, summary, config_path),
    }


# ----------------------------------------------------------------------------------------- verdict


def verdict(trace: Trace, summary: dict[str, Any]) -> dict[str, Any]:
    """``{tone, as_is, plan}``: ``tone`` is ``ok`` (fits, as it is or with the plan), ``bad`` (does
    not fit and no plan is known to) or ``info`` (no budget to judge against); ``as_is`` says how the
    profiled run itself did; ``plan`` how the plan does (measured or predicted), or None."""
    plan = summary.get("plan")
    measured = measured_round(trace)
    if not plan:
        return {"tone": "info", "as_is": None, "plan": None, "measured": None}
    fits_now = bool(plan.get("fits_as_is")) and summary.get("fault") is None
    if fits_now:
        plan_fits = True
    elif plan.get("verified_fits") is not None:
        plan_fits = bool(plan["verified_fits"])
    else:
        plan_fits = bool(plan.get("fits"))
    return {
        "tone": "ok" if plan_fits else "bad",
        "as_is": "fits" if fits_now else "does not fit",
        "plan": None if fits_now else ("fits" if plan_fits else "does not fit"),
        "measured": measured,
    }


def measured_round(trace: Trace) -> dict[str, Any] | None:
    """The verified round whose config is the plan (``profile --verify``), else None: only predicted."""
    return chosen_round(rounds_with_error(trace))


# ----------------------------------------------------------------------------------------- what ate it


def eaters(trace: Trace, limit: int = TOP_EATERS) -> list[dict[str, Any]]:
    """The layers of the memory-by-layer chart holding the most bytes at the peak step, largest first,
    each with its largest category; blocks of one class holding the same bytes (``layer.0`` to
    ``layer.8`` of an encoder) are one row, so that five rows name more than one repeated block. A
    grouped "other" bar is not a layer and is left out."""
    step = peak_step(trace)
    if step is None:
        return []
    bars = [b for b in top_layers(trace, step, limit=10 * TOP_LAYERS) if b["total"] > 0 and b["type"]]
    rows = [_eater(group) for group in _same_blocks(bars)]
    return sorted(rows, key=lambda r: -r["bytes"])[:limit]


def _same_blocks(bars: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``bars`` (in model order) in groups: one class, each within ``SAME_SHARE`` of the group's first."""
    groups: list[list[dict[str, Any]]] = []
    for bar in bars:
        home = next((g for g in groups if _same(g[0], bar)), None)
        if home is None:
            groups.append([bar])
        else:
            home.append(bar)
    return groups


SAME_SHARE = 0.01


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["type"] == b["type"]
        and a["own"] == b["own"]
        and abs(a["total"] - b["total"]) <= SAME_SHARE * a["total"]
    )


def _after_common(first: str, last: str) -> str:
    """``last`` without the dotted components it shares with ``first`` (``encoder.layer.8`` -> ``8``)."""
    a, b = first.split("."), last.split(".")
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return ".".join(b[shared:]) or last


def _eater(group: list[dict[str, Any]]) -> dict[str, Any]:
    cats = {
        k: sum(b[k] for b in group) for k in ("parameters", "gradients", "optimizer_state", "activations")
    }
    main = max(cats, key=lambda k: cats[k])
    first, last = group[0]["name"], group[-1]["name"]
    name = first if len(group) == 1 else f"{first} … {_after_common(first, last)}"
    total = sum(b["total"] for b in group)
    return {"name": name, "count": len(group), "each": group[0]["total"], "bytes": total, "main": main}


def code_lines(trace: Trace, summary: dict[str, Any], limit: int = TOP_LINES) -> list[dict[str, Any]]:
    """The code lines outside the layers that held the most at the peak: the peak ledger's temporaries
    by allocating line (CUDA) and what the model's own code or the loop saved (``outside_modules``)."""
    peak = summary.get("peak_memory_bytes") or 0
    floor = LINE_MIN_SHARE * peak
    found: dict[str, int] = {}
    for site, n in (summary.get("peak_ledger") or {}).get("temporaries_by_site") or []:
        found[str(site)] = found.get(str(site), 0) + int(n or 0)
    for row in outside_holders(trace, peak_step(trace)):
        found[row["site"]] = max(found.get(row["site"], 0), row["activation_bytes"] + row["temporary_bytes"])
    rows = sorted(found.items(), key=lambda kv: -kv[1])
    return [{"site": site, "bytes": n} for site, n in rows[:limit] if n > 0 and n >= floor]


# ----------------------------------------------------------------------------------------- command


def command(trace: Trace, summary: dict[str, Any], config_path: str) -> dict[str, Any]:
    """``{text, applies}``: the command that applies the plan (``applies``) or, when it fits as it is,
    the script's own command; absolute paths, after a ``cd`` into the folder the profile ran in (the
    script's own arguments may name files relative to it), so it works when pasted anywhere."""
    plan = summary.get("plan") or {}
    if not plan:
        return {"text": None, "applies": False}
    target = script_target(trace)
    cd = _cd(trace)
    if plan.get("fits_as_is") and summary.get("fault") is None:
        text = cd + shlex.join(["python", *target, *script_args(trace)]) if target else None
        return {"text": text, "applies": False}
    return {"text": cd + apply_command(trace, config_path), "applies": True}


def apply_command(trace: Trace, config_path: str) -> str:
    """``memdoctor run --config CONFIG SCRIPT -- ARGS``: the plan applied to the unmodified script, with
    the config's and the script's absolute paths (no ``cd``: ``command`` adds it)."""
    config = os.path.abspath(config_path)
    target = script_target(trace)
    if not target:
        return f"memdoctor run --config {shlex.quote(config)} SCRIPT -- ARGS"
    return shlex.join(["memdoctor", "run", "--config", config, *target, "--", *script_args(trace)])


def script_target(trace: Trace) -> list[str]:
    """The profiled script as an absolute path (relative ones joined to the profile's folder), or
    ``-m module``; [] when the trace does not say."""
    cmd = trace.header.get("command") or {}
    script, cwd = cmd.get("script"), cmd.get("cwd")
    if cmd.get("module"):
        return ["-m", str(cmd["module"])]
    if not script:
        return []
    script = str(script)
    if not os.path.isabs(script) and cwd:
        script = os.path.join(str(cwd), script)
    return [os.path.normpath(script)]


def script_args(trace: Trace) -> list[str]:
    return [str(a) for a in (trace.header.get("command") or {}).get("argv") or []]


def _cd(trace: Trace) -> str:
    cwd = (trace.header.get("command") or {}).get("cwd")
    return f"cd {shlex.quote(str(cwd))} && " if cwd else ""
