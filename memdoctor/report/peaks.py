"""Which peak is which: every peak the report quotes, with the memory it counts (allocated or reserved),
how it was obtained (measured, extrapolated or predicted) and why it differs from the others.

Why: one page quotes up to five peaks, and by design they differ. A run that died measured only what
it reached (7.95 GiB); the plan is made from the whole step, extrapolated from a re-profile (11.76 GiB);
a card must also hold the allocator's reserve (12.36 GiB reserved, predicted); the plan is predicted
(7.21 GiB) and, verified, measured (7.01 GiB). Without the kind of each, the page reads as if it
disagreed with itself. ``peak_rows`` lists them in that order, each once; ``footer_note`` says which
kinds the page holds, and nothing more.
"""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.headline import peak_memory_word
from memdoctor.analysis.verified import chosen_round, rounds_with_error
from memdoctor.plan.config import Config
from memdoctor.plan.model import predict, workload
from memdoctor.plan.reprofiled import peak_words
from memdoctor.trace import Trace
from memdoctor.units import format_bytes


def peak_rows(trace: Trace, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{bytes, memory, kind, what}]``: ``memory`` "allocated", "in tensors" or "reserved"; ``kind``
    "measured", "extrapolated" or "predicted"; ``what`` where the page quotes it and why it differs."""
    rows = []
    peak = summary.get("peak_memory_bytes")
    if peak is not None:
        died = summary.get("peak_from_incomplete_step")
        step = summary.get("peak_step")
        what = f"the run as it is, step {step}: the headline, the charts and the step table"
        if died:
            what += "; the run died in that step, so this is what it reached (a lower bound)"
        rows.append(_row(peak, peak_memory_word(summary), "measured", what))
    w = workload(trace, summary)
    plan = summary.get("plan")
    if w is not None and w.peak_bytes != peak:
        words = peak_words(trace, w).split(", ", 1)[-1]
        what = f"the whole step the plan and the findings are made from: {words}"
        rows.append(_row(w.peak_bytes, "allocated", "extrapolated", what))
    if w is not None and plan:
        base = predict(w, Config())
        reached = "" if w.complete else ", the modules it never reached extrapolated"
        what = (
            f"the script as it is on a card: its predicted {format_bytes(base.peak_bytes)} allocated"
            f"{reached}, x{base.reserved_bytes / max(base.peak_bytes, 1):.2f} for what the allocator "
            'reserves beyond what it allocates; the card table\'s "fits as-is" rows'
        )
        rows.append(_row(base.reserved_bytes, "reserved", "predicted", what))
        if not plan.get("fits_as_is"):
            levers = "; ".join(plan.get("levers") or []) or "as it is"
            what = f"the plan ({levers})"
            rows.append(_row(plan["predicted_reserved_bytes"], "reserved", "predicted", what))
    measured = verified_peak(trace)
    if measured is not None:
        rows.append(measured)
    return rows


def verified_peak(trace: Trace) -> dict[str, Any] | None:
    """The plan's peak as ``profile --verify`` measured it (the round whose config is the plan)."""
    rows = rounds_with_error(trace)
    final = chosen_round(rows) if rows else None
    if final is None or final.get("measured_peak_bytes") is None:
        return None
    memory = "reserved" if final.get("peak_basis") == "reserved" else "in tensors"
    what = f'the plan applied, verify round {final["round"]}: "Measured vs predicted"'
    return _row(int(final["measured_peak_bytes"]), memory, "measured", what)


def footer_note(rows: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
    """What the page's figures are, as far as the page shows: "none is predicted" only where no
    predicted or extrapolated figure (a plan, a finding's saving) is on it."""
    kinds = {r["kind"] for r in rows}
    if any(f.get("saving_bytes") for f in findings):
        kinds.add("predicted")
    if kinds <= {"measured"}:
        return "Every figure is measured in that run; none is predicted."
    parts = ["measured figures come from that run"]
    if "extrapolated" in kinds:
        parts.append("extrapolated ones from what it measured, where it did not reach")
    if "predicted" in kinds:
        parts.append("predicted ones (the plan, the card table, findings' savings) from memdoctor's model")
    if any(r["kind"] == "measured" and r["what"].startswith("the plan applied") for r in rows):
        parts.append("the plan's peak was then measured with it applied")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + ". Each peak says which it is."


STACK = ("parameters", "gradients", "optimizer_state", "activations", "other")


def peak_parts(trace: Trace, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The re-profile a plan is made from, beside the run it stands in for: ``[{label, kind, parts}]``
    (allocated bytes by category) for the run as it is (measured until it died), the re-profile at
    micro-batch 1/k (measured), the full batch from it (extrapolated), the plan (predicted) and the
    plan verified (measured, its total only). Empty unless the plan comes from a micro-batch re-profile:
    only then is the step the plan is made from a different run from the one the page measured."""
    w = workload(trace, summary)
    found = summary.get("reprofile") or {}
    k = found.get("accumulation_steps")
    peak = summary.get("peak_memory_bytes")
    if (
        w is None
        or peak is None
        or not found.get("planned_from_reprofile")
        or found.get("method") != "micro_batch"
    ):
        return []
    if not k:
        return []
    cats = summary.get("categories") or {}
    bars = [_bar("the run as it is, until it died", "measured", {c: cats.get(c) for c in STACK[:4]}, peak)]
    state = {
        "parameters": w.parameters,
        "gradients": w.gradients_at_peak,
        "optimizer_state": w.optimizer_state,
    }
    # the re-profile's own peak: the full batch's less what ``full_batch`` added for the other k-1 parts
    one = w.peak_bytes - (w.activations + w.temporaries) * (k - 1) // k
    micro = {**state, "activations": w.activations // k}
    bars.append(_bar(f"the re-profile, micro-batch 1/{k}", "measured", micro, one))
    full = {**state, "activations": w.activations}
    bars.append(_bar("the full batch, from the re-profile", "extrapolated", full, w.peak_bytes))
    plan = summary.get("plan") or {}
    breakdown = (plan.get("prediction") or {}).get("breakdown") or {}
    if breakdown and not plan.get("fits_as_is"):
        bars.append(
            _bar(
                "the plan",
                "predicted",
                {c: breakdown.get(c) for c in STACK[:4]},
                plan["predicted_peak_bytes"],
            )
        )
    final = chosen_round(rounds_with_error(trace))
    if final is not None and final.get("measured_allocated_peak_bytes"):
        total = int(final["measured_allocated_peak_bytes"])
        bars.append(_bar("the plan, verified", "measured", {"other": total}, total))
    return bars


def _bar(label: str, kind: str, parts: dict[str, Any], total: int) -> dict[str, Any]:
    """A bar whose parts add up to ``total``: what the named categories leave is "other" (where they
    come to more, an assumed part such as optimizer state not yet created, the total is theirs)."""
    known = {c: int(parts.get(c) or 0) for c in STACK[:4]}
    known["other"] = int(parts["other"]) if "other" in parts else max(0, int(total) - sum(known.values()))
    return {"label": label, "kind": kind, "parts": known, "total": max(int(total), sum(known.values()))}


def _row(n: int, memory: str, kind: str, what: str) -> dict[str, Any]:
    return {"bytes": int(n), "memory": memory, "kind": kind, "what": what}
