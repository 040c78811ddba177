"""The nine-grid: where the workload sits on three axes, each low / medium / high, with the raw figures.

* compute intensity: the ``compute`` section's measured class (arithmetic intensity against the device's
  ridge point; see ``memdoctor.analysis.compute``);
* parameter scale: model state (parameters + gradients + optimizer state) as a share of the budget:
  low below ``STATE_LOW`` (25%), high at ``STATE_HIGH`` (60%) or more: at that point activations have
  little room left and state-side levers (8-bit optimizer, offload) matter more than checkpointing;
* data traits: the ``data`` section's traits level (how much the batches' shapes pad or vary).

An axis that the trace did not measure is ``null`` with the reason.
"""

from __future__ import annotations

from typing import Any

from memdoctor.plan.model import Workload

STATE_LOW = 0.25
STATE_HIGH = 0.60


def ninegrid(summary: dict[str, Any], w: Workload | None, budget_bytes: int | None) -> dict[str, Any]:
    """``{compute, parameter_scale, data}``: each ``{level, figures, evidence}`` or None with a reason."""
    return {
        "compute": compute_axis(summary),
        "parameter_scale": parameter_axis(w, budget_bytes),
        "data": data_axis(summary),
    }


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
