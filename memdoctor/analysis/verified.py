"""The "Measured vs predicted" section: what ``memdoctor profile --verify`` measured against the plan.

``--verify`` (``memdoctor.launch.verify``) writes a run-wide ``collector`` record named ``verify`` into
the first run's trace: one entry per verified round (the config applied, its predicted and measured
peak and step time). ``summarize`` turns the last round into ``summary.json``'s ``verified`` (null when
the run was not verified); ``verify_record`` and ``rounds_with_error`` are what the report's section
shows. Pure data: no torch.
"""

from __future__ import annotations

import re
from typing import Any

from memdoctor.trace import Trace
from memdoctor.units import format_bytes

RECORD_NAME = "verify"  # memdoctor.launch.verify.RECORD_NAME (not imported: that module runs profiles)
APPLIED_NOTE = (
    "this run was profiled with a memdoctor.yaml applied (the header's applied_config): it is itself the "
    "run that verifies a plan, and the comparison is in the report of the run that made the plan"
)
_ROUND_KEYS = (
    "round",
    "trace",
    "levers",
    "correction",
    "outcome",
    "fits",
    "status",
    "config_applied",
    "peak_basis",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "predicted_allocated_peak_bytes",
    "measured_allocated_peak_bytes",
    "predicted_step_time_ratio",
    "measured_step_time_ratio",
    "measured_step_time_ms",
    "step_time_basis",
    "avoided",
    "margin",
    "message",
    "refused_lever",
    "excluded",
)

_NUMBERS = tuple(
    k
    for k in _ROUND_KEYS
    if k.endswith(("_bytes", "_ratio", "_ms")) or k in ("round", "correction", "margin")
)
# A compared round (``avoided`` set: the best plan without the first plan's micro-batching or
# checkpointing, ``memdoctor.launch.verify``) becomes the plan when its measured step time is at least
# this much shorter; less is within the run-to-run noise of short runs (BENCHMARKS.md).
COMPARED_MIN_GAIN = 0.03


def rounds(trace: Trace) -> list[dict[str, Any]]:
    """The verified rounds recorded in ``trace`` (each with every ``_ROUND_KEYS`` key), in order."""
    record = trace.collected.get(RECORD_NAME) or {}
    found = record.get("rounds")
    rows = [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []
    return [_clean(r) for r in rows]


def _clean(r: dict[str, Any]) -> dict[str, Any]:
    """One round with every key, numbers only where numbers belong (a trace is input: never trust it)."""
    out = {key: r.get(key) for key in _ROUND_KEYS}
    for key in _NUMBERS:
        out[key] = _number(out[key])
    levers = out["levers"]
    out["levers"] = [str(v) for v in levers] if isinstance(levers, list) else []
    for key in ("fits", "config_applied"):
        out[key] = out[key] is True
    for key in ("trace", "outcome", "status", "peak_basis", "avoided", "step_time_basis", "message"):
        out[key] = None if out[key] is None else str(out[key])
    out["refused_lever"] = out["refused_lever"] if out["refused_lever"] in FAMILIES else None
    excluded = out["excluded"]
    out["excluded"] = [str(v) for v in excluded if v in FAMILIES] if isinstance(excluded, list) else []
    out["reason"] = round_reason(out)
    return out


def peak_error(measured: Any, predicted: Any) -> float | None:
    """(measured - predicted) / predicted: positive means the plan under-predicted (an OOM risk)."""
    if not isinstance(measured, (int, float)) or not isinstance(predicted, (int, float)) or predicted <= 0:
        return None
    return round((measured - predicted) / predicted, 4)


def chosen_round(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round whose config is the plan: the first that fits, unless a compared round fits and
    measured a step time ``COMPARED_MIN_GAIN`` shorter; None when no round fits."""
    fitting = [r for r in rows if r.get("fits") is True]
    if not fitting:
        return None
    first = next((r for r in fitting if not r.get("avoided")), fitting[0])
    faster = [r for r in fitting if r.get("avoided") and _faster(r, first)]
    return min(faster, key=lambda r: r["measured_step_time_ms"]) if faster else first


def _faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = a.get("measured_step_time_ms"), b.get("measured_step_time_ms")
    numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in (ta, tb))
    return numbers and float(ta) < float(tb) * (1.0 - COMPARED_MIN_GAIN)  # type: ignore[arg-type]


def verified(trace: Trace) -> dict[str, Any] | None:
    """``summary.json``'s ``verified``: the figures of the round whose config is the plan (the last
    round when none fits), the round count and every round; whether the plan is a measured config
    that fits (``plan_verified``), whether the first plan was (``first_shot_fits``), each round that
    did not fit with why (``failed_rounds``), and the lever families ``memdoctor run`` refused for
    this script (``excluded``: no later plan uses them)."""
    rows = rounds(trace)
    if not rows:
        return None
    best = chosen_round(rows)
    last = best or rows[-1]
    keys = [k for k in _ROUND_KEYS if k not in ("round", "levers", "correction", "status", "message")]
    out = {k: last[k] for k in keys}
    out["peak_error"] = peak_error(last["measured_peak_bytes"], last["predicted_peak_bytes"])
    out["round"] = last["round"]
    out["reason"] = last["reason"]
    out["rounds"] = len(rows)
    out["plan_verified"] = best is not None
    out["first_shot_fits"] = rows[0]["fits"]
    out["failed_rounds"] = failed_rounds(rows)
    out["excluded"] = learned(trace)["excluded"]
    out["history"] = rows
    return out


def failed_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round that did not fit: its number, outcome, levers and why, in words."""
    keys = ("round", "outcome", "levers", "refused_lever", "reason")
    return [{k: r[k] for k in keys} for r in rows if not r["fits"]]


def learned(trace: Trace) -> dict[str, Any]:
    """What the verify rounds taught the planner (the record's ``learned``): ``correction``, the factor
    the plan's memory predictions are raised by after the last round, and ``excluded``, the lever
    families ``memdoctor run`` refused for this script; for a record without it, the largest correction
    and the refusals its rounds record."""
    record = trace.collected.get(RECORD_NAME) or {}
    found = record.get("learned") if isinstance(record, dict) else None
    if not isinstance(found, dict):  # a record written before it had one: what its rounds say
        rows = rounds(trace)
        refused = [r["refused_lever"] for r in rows if r["refused_lever"]]
        found = {"correction": max([r["correction"] or 1.0 for r in rows], default=1.0), "excluded": refused}
    factor = _number(found.get("correction"))
    excluded = found.get("excluded")
    return {
        "correction": float(factor) if factor is not None and factor >= 1.0 else 1.0,
        "excluded": [str(v) for v in excluded if v in FAMILIES] if isinstance(excluded, list) else [],
    }


def summarize(trace: Trace, summary: dict[str, Any]) -> None:
    """``verified``: null unless the run was profiled with ``--verify`` and at least one round ran."""
    summary["verified"] = verified(trace)


def verify_record(trace: Trace) -> dict[str, Any] | None:
    """The verify record's run-wide fields (why it was skipped or stopped, the budget, the round limit,
    the OOM floor); a run profiled with a plan applied is itself a verify round, and says so. None when
    the run was not verified."""
    record = trace.collected.get(RECORD_NAME)
    if not isinstance(record, dict) and trace.header.get("applied_config") is not None:
        record = {"skipped": APPLIED_NOTE}
    if not isinstance(record, dict):
        return None
    return {
        "skipped": record.get("skipped"),
        "stopped": record.get("stopped"),
        "budget_bytes": _number(record.get("budget_bytes")),
        "max_rounds": _number(record.get("max_rounds")),
        "oom_floor": _number(record.get("oom_floor")),
    }


def rounds_with_error(trace: Trace) -> list[dict[str, Any]]:
    """``rounds`` with each round's ``peak_error``, for the report's table."""
    rows = rounds(trace)
    for r in rows:
        r["peak_error"] = peak_error(r["measured_peak_bytes"], r["predicted_peak_bytes"])
    return rows


def _number(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ----------------------------------------------------------------------------------------- why a round failed

# The planner's lever families (``memdoctor.plan.config.Config.families``; not imported: the planner
# imports this module), and the memdoctor.yaml field each refusal message of ``memdoctor run`` starts
# with (``memdoctor.levers``: "accumulation_steps: the model's forward returns no loss ...").
FAMILIES = ("checkpoint", "accumulation", "precision", "8bit", "offload", "padding", "attention", "allocator")
_FIELD_FAMILY = {
    "checkpoint": "checkpoint",
    "accumulation_steps": "accumulation",
    "micro_batch": "accumulation",
    "precision": "precision",
    "grad_scaler": "precision",
    "offload_parameters": "offload",
    "padding": "padding",
    "pad_to_multiple_of": "padding",
    "attention": "attention",
    "allocator": "allocator",
}
_FIELD = re.compile(r"\b(" + "|".join([*_FIELD_FAMILY, "optimizer"]) + r")\b(?:\.\w+)?:\s*([\w-]*)")


def refused_family(message: str | None, config: dict[str, Any]) -> str | None:
    """The lever family a refusal ``message`` names (its first config field), when ``config`` uses it;
    None when it names none the planner could leave out (a stale config's missing modules, the
    data_loader, which the planner never sets)."""
    found = _FIELD.search(message or "")
    if found is None:
        return None
    name, value = found.group(1), found.group(2)
    family = _FIELD_FAMILY.get(name, value)  # optimizer: its value names the family (8bit, offload)
    return family if family in _families(config) else None


def _families(config: dict[str, Any]) -> set[str]:
    """The lever families a memdoctor.yaml mapping uses (as ``Config.families`` says of a plan)."""
    used = {
        "checkpoint": bool(config.get("checkpoint")),
        "accumulation": (config.get("accumulation_steps") or 1) > 1,
        "precision": config.get("precision") not in (None, "fp32"),
        "8bit": config.get("optimizer") == "8bit",
        "offload": config.get("optimizer") == "offload" or bool(config.get("offload_parameters")),
        "padding": config.get("padding") not in (None, "as-is"),
        "attention": config.get("attention") is not None,
        "allocator": config.get("allocator") is not None,
    }
    return {k for k, v in used.items() if v}


_REFUSED_PREFIX = "the plan could not be applied: "  # the supervisor's message for a config_error


def round_reason(r: dict[str, Any]) -> str:
    """Round ``r``'s outcome in words: measured against predicted, or what refused or failed it."""
    predicted, measured = r.get("predicted_peak_bytes"), r.get("measured_peak_bytes")
    pred = f"{format_bytes(predicted)} predicted" if predicted else "no prediction"
    outcome = r.get("outcome")
    if outcome == "fits":
        return f"fits: measured {format_bytes(measured)} vs {pred}"
    if outcome == "oom":
        seen = f", {format_bytes(measured)} measured before it died" if measured else ""
        return f"ran out of memory ({pred}{seen})"
    if outcome == "over_budget":
        return f"over the budget: measured {format_bytes(measured)} vs {pred}"
    message = str(r.get("message") or "")
    if outcome == "refused":
        family = r.get("refused_lever")
        out = f"refused by memdoctor run: {message.removeprefix(_REFUSED_PREFIX) or 'no message'}"
        return out + (f" ({family} is left out of every later plan)" if family else "")
    return f"the run failed ({r.get('status')}: {message or 'no message'})"


# ----------------------------------------------------------------------------------------- the plan's verdict


def plan_note(trace: Trace, plan: dict[str, Any]) -> str | None:
    """What ``--verify`` measured of ``plan`` (the report's, made by the search of the chosen round, or
    with everything the rounds ``learned`` when none fits), in one paragraph for memdoctor.yaml's
    header, the plan's advice and the terminal; None when the run was not verified."""
    rows = rounds(trace)
    if not rows:
        return None
    best = chosen_round(rows)
    if best is not None:
        return (
            f"measured to fit by memdoctor profile --verify: round {best['round']} ({best['trace']}) "
            f"applied this config and measured {format_bytes(best['measured_peak_bytes'])} against "
            f"{format_bytes(best['predicted_peak_bytes'])} predicted"
        )
    failed = "; ".join(f"round {r['round']} ({_levers(r)}): {r['reason']}" for r in rows)
    n = len(rows)
    out = f"NOT verified to fit: memdoctor profile --verify measured no config that fits in {n} round"
    return out + f"{'s' if n > 1 else ''}: {failed}. {what_to_try(trace, plan)}"


def what_to_try(trace: Trace, plan: dict[str, Any]) -> str:
    """When no verified round fits: what ``plan`` (searched with what the rounds ``learned``) is, and
    what to try with it."""
    searched = _learned_words(learned(trace))
    if plan.get("fits"):
        return (
            f"This config is the planner's re-plan after those rounds ({searched}), which no round "
            "measured: try it with `memdoctor profile --config memdoctor.yaml --budget SIZE SCRIPT` (it "
            "profiles the script with it applied), or verify more rounds (--verify-rounds N)"
        )
    return (
        f"Re-planned after those rounds ({searched}), nothing the planner models fits the budget: this "
        "is the closest config, not predicted to fit; see the plan's advice (a larger budget, a smaller "
        "batch or sequence)"
    )


def _levers(r: dict[str, Any]) -> str:
    return "; ".join(r["levers"]) or "no change"


def _learned_words(found: dict[str, Any]) -> str:
    parts = []
    if found["correction"] > 1.0:
        parts.append(f"memory predictions raised x{found['correction']:.2f}")
    if found["excluded"]:
        parts.append(f"without {', '.join(found['excluded'])}, which memdoctor run refused for this script")
    return "; ".join(parts) or "with the same predictions"
