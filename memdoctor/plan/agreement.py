"""Whether each finding's lever is in the plan, and why not where it is not (``plan_notes``).

Why: the rules and the planner read the same workload but answer different questions. A rule says what
one lever would save on its own; the planner picks the cheapest set of levers that fits the budget. So a
finding may propose a lever the plan leaves out (padding "saves 3.63 GiB" while the plan keeps padding
as it is), and without a reason given the page contradicts itself. Each finding about a memory lever
gets one phrase, ``plan_note``, that says "in the plan" or why the plan differs, from the same figures
the planner used.
"""

from __future__ import annotations

from typing import Any

from memdoctor.plan.padding import PAD_MULTIPLE, TRIM_MIN_SAVING
from memdoctor.plan.planner import Plan
from memdoctor.plan.rules import RULE_FAMILY, padding_peak_saving
from memdoctor.plan.workload import Workload
from memdoctor.units import format_bytes


def plan_notes(findings: list[dict[str, Any]], plan: Plan | None, w: Workload | None) -> None:
    """Set each finding's ``plan_note``: None where the finding proposes no lever (time, health) or there
    is no plan; else whether its lever is in the plan, or the one reason it is not."""
    for f in findings:
        family = RULE_FAMILY.get(str(f.get("rule")))
        # the padding finding proposes a lever even where it saves nothing at the peak (it saves time)
        proposes = family is not None and ((f.get("saving_bytes") or 0) > 0 or family == "padding")
        f["plan_note"] = _note(f, family, plan, w) if proposes and plan is not None else None


def _note(f: dict[str, Any], family: str | None, plan: Plan, w: Workload | None) -> str:
    pick = plan.chosen or plan.closest
    used = family in pick.config.families() or (family == "8bit" and pick.config.optimizer == "offload")
    if used and family == "checkpoint":
        n = len(pick.config.checkpoint)
        return f"in the plan: {n} module{'s' if n != 1 else ''}, only as many as the budget needs"
    if used:
        return "in the plan"
    if plan.fits_as_is:
        return "not in the plan: the script fits the budget as it is"
    if family == "padding" and w is not None:
        return padding_note(w)
    if not plan.fits:
        return "not in the plan: nothing the planner tried fits, with or without it"
    if family == "precision":
        return "not in the plan: the plan fits without changing the numerics"
    return "not in the plan: the plan fits with levers predicted to cost less time"


def padding_note(w: Workload) -> str:
    """Why the plan keeps the padding: the longest batch sets the peak, however short the mean one is."""
    pad = w.padding
    if pad is None:
        return f"not in the plan: {w.padding_unavailable or 'the batches lengths were not measured'}"
    freed = padding_peak_saving(w)
    if freed < TRIM_MIN_SAVING * w.activations:
        return (
            f"not in the plan: it frees only {format_bytes(freed)} at the peak, where the longest batch "
            f"keeps a {pad.worst_longest}-token sequence of the {pad.padded} padded; the plan changes only "
            "what the budget needs"
        )
    if not pad.worth_trimming():
        return (
            f"not in the plan: the mean batch would get {1 - pad.mean_ratio('trim', PAD_MULTIPLE):.0%} "
            f"shorter, under the {TRIM_MIN_SAVING:.0%} that pays for batches changing shape"
        )
    return "not in the plan: the plan fits with levers predicted to cost less time"
