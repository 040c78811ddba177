"""The nine-grid: where the workload sits on three axes, each low / medium / high, with the raw figures.

* compute intensity: the ``compute`` section's measured class (arithmetic intensity against the device's
  ridge point; see ``memdoctor.analysis.flops``);
* parameter scale: model state (parameters + gradients + optimizer state) as a share of the budget:
  low below ``STATE_LOW`` (25%), high at ``STATE_HIGH`` (60%) or more: at that point activations have
  little room left and state-side levers (8-bit optimizer, offload) matter more than checkpointing;
* data traits: the ``data`` section's traits level (how much the batches' shapes pad or vary).

An axis that the trace did not measure is ``null`` with the reason.

The cell drives the order of the levers (``lever_priority``, the table in ``docs/planner.md``): the
rules' findings are listed in that order, and the planner breaks ties between configs as fast and as
simple as each other by it.
"""

from __future__ import annotations

from typing import Any

from memdoctor.plan.workload import Workload

STATE_LOW = 0.25
STATE_HIGH = 0.60
AXES = {"compute": "compute intensity", "parameter_scale": "parameter scale", "data": "data traits"}
# Lever families, as ``memdoctor.plan.config.Config.families`` names them.
ACTIVATION_FIRST = ("checkpoint", "offload", "8bit")  # activations dominate: recompute them first
STATE_FIRST = ("8bit", "offload", "checkpoint")  # model state dominates: shrink or move it first
THEN = ("padding", "accumulation", "attention", "allocator", "precision")  # numerics last


def ninegrid(summary: dict[str, Any], w: Workload | None, budget_bytes: int | None) -> dict[str, Any]:
    """``{compute, parameter_scale, data}``: each ``{level, figures, evidence}`` or None with a reason."""
    return {
        "compute": compute_axis(summary),
        "parameter_scale": parameter_axis(w, budget_bytes),
        "data": data_axis(summary),
    }


def lever_priority(grid: dict[str, Any] | None) -> list[str]:
    """The lever families in the order the cell ranks them (``docs/planner.md``, "Rule priority"):

    * heavy padding (data traits high): trimming padding first: it is pure waste, and removing it
      saves memory and time without changing the numerics;
    * parameter scale high, or compute intensity low (few FLOPs per byte: a small batch against many
      parameters): model state dominates, so the 8-bit optimizer and offload come before checkpointing;
    * otherwise (compute intensity high or medium, or not measured): activations dominate, so
      checkpointing comes first, then offload (the usual hand-tuning order);
    * then padding, smaller micro-batches, memory-efficient attention, the allocator, and mixed
      precision last (it changes the numerics)."""
    grid = grid or {}

    def level(axis: str) -> str | None:
        return (grid.get(axis) or {}).get("level")

    first = ["padding"] if level("data") == "high" else []
    state = level("parameter_scale") == "high" or level("compute") == "low"
    order = first + list(STATE_FIRST if state else ACTIVATION_FIRST) + list(THEN)
    return list(dict.fromkeys(order))


def priority_evidence(grid: dict[str, Any] | None) -> str:
    """One sentence: why the cell puts the levers in ``lever_priority``'s order."""
    grid = grid or {}
    levels = {a: (grid.get(a) or {}).get("level") or "not measured" for a in AXES}
    cell = ", ".join(f"{AXES[a]} {levels[a]}" for a in AXES)
    why = ["heavy padding: trim it first"] if levels["data"] == "high" else []
    if levels["parameter_scale"] == "high" or levels["compute"] == "low":
        why.append("model state dominates: shrink or move it before checkpointing")
    else:
        why.append("activations dominate: checkpoint first")
    return f"{cell}: " + "; ".join(why) + "; mixed precision last"


def priority(grid: dict[str, Any] | None) -> dict[str, Any]:
    """summary.json's ``lever_priority``: ``{order, evidence}`` for the cell."""
    return {"order": lever_priority(grid), "evidence": priority_evidence(grid)}


def compute_axis(summary: dict[str, Any]) -> dict[str, Any]:
    compute = summary.get("compute")
    if not compute or not compute.get("class"):
        return _unmeasured("compute intensity was not measured (no flops collector data in this trace)")
    return {
        "level": compute["class"],
        "figures": {
            "arithmetic_intensity": compute.get("arithmetic_intensity"),
            "ridge_point": (compute.get("roofline") or {}).get("ridge_point"),
        },
        "evidence": compute.get("evidence"),
    }


def parameter_axis(w: Workload | None, budget_bytes: int | None) -> dict[str, Any]:
    if w is None:
        return _unmeasured("no step of this trace has a memory ledger")
    if not budget_bytes:
        return _unmeasured("no budget to compare the model state with (give --budget or --gpu)")
    state = w.parameters + w.gradients + w.optimizer_state
    share = state / budget_bytes
    level = "low" if share < STATE_LOW else "high" if share >= STATE_HIGH else "medium"
    return {
        "level": level,
        "figures": {"model_state_bytes": state, "budget_bytes": budget_bytes, "share": round(share, 4)},
        "evidence": f"parameters, gradients and optimizer state take {share:.0%} of the budget",
    }


def data_axis(summary: dict[str, Any]) -> dict[str, Any]:
    traits = (summary.get("data") or {}).get("traits") or {}
    if not traits.get("level"):
        return _unmeasured("batch shapes were not measured (no data collector data in this trace)")
    return {
        "level": traits["level"],
        "figures": {"class": traits.get("class"), "padding_fraction": summary.get("padding_fraction")},
        "evidence": traits.get("evidence"),
    }


def _unmeasured(reason: str) -> dict[str, Any]:
    return {"level": None, "figures": None, "evidence": reason}
