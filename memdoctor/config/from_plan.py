"""The plan of ``summary.json`` as a ``memdoctor.yaml`` config (``from_plan``, ``config_for_summary``).

The planner's levers (``memdoctor.plan.config.Config``) carry the file's field names and values, so they
pass through as they are (``file_levers``, the one place where the two could differ); the file adds the
micro-batch, the GradScaler settings and where the plan came from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from memdoctor.config.file import GradScalerSettings, PlanConfig, Provenance
from memdoctor.plan.config import Config, config_from_dict
from memdoctor.plan.splits import planned_split


def file_levers(levers: Config) -> dict[str, Any]:
    """``levers`` as ``PlanConfig`` fields: each as it is, but a padding policy that truncates sequences
    (it changes the data: the planner never plans one, only offers it as advice, and the file cannot say
    it) keeps the profiled padding, and a length multiple goes only with trimming."""
    fields = {f.name: getattr(levers, f.name) for f in dataclasses.fields(levers)}
    if levers.changes_data():
        fields["padding"] = "as-is"
    if fields["padding"] != "trim":
        fields["pad_to_multiple_of"] = None
    return fields


def from_plan(
    plan: dict[str, Any], *, trace: Any = None, trace_path: str | None = None, batch_size: int | None = None
) -> PlanConfig:
    """The config for ``summary["plan"]`` (the planner's chosen, else closest, config)."""
    levers = config_from_dict(plan.get("config") or {})
    if levers.precision == "fp32" and plan.get("script_autocast") == "bf16":
        # The plan keeps the script's own bf16 autocast: the file says so (its exports then ask a
        # framework for bf16, not fp32), and ``memdoctor run`` adds nothing inside the script's autocast.
        # Not for fp16: the file's fp16 comes with memdoctor's loss scaling, the script has its own.
        levers = dataclasses.replace(levers, precision="bf16")
    k = levers.accumulation_steps
    model = _planned_model(trace, plan.get("model"))
    per_rank = -(-batch_size // levers.gpus) if batch_size and levers.parallel is not None else batch_size
    micro = per_rank // k if per_rank and per_rank % k == 0 else None  # a rank's (the batch split over gpus)
    ratio = plan.get("predicted_step_time_ratio")
    split = (
        planned_split(trace) if k > 1 else None
    )  # how memdoctor run splits (the planner checked it applies)
    return PlanConfig(
        **file_levers(levers),
        accumulation_split=split.kind if split is not None else None,
        script_args=tuple(split.script_args(k)) if split is not None else (),
        grad_scaler=_plan_scaler(plan) if levers.precision == "fp16" else None,
        micro_batch=micro,
        provenance=Provenance(
            trace=trace_path,
            model_class=model.cls if model is not None else None,
            module_count=len(model.names) if model is not None else None,
            param_count=sum(model.param_counts) if model is not None else None,
            budget_bytes=plan.get("budget_bytes"),
            fits=plan.get("fits"),
            predicted_peak_bytes=plan.get("predicted_peak_bytes"),
            predicted_step_time_ratio=None if ratio is None else float(ratio),
            verified=plan.get("verified_fits"),
            verify_note=plan.get("verify_note"),
        ),
    )


def _planned_model(trace: Any, index: Any) -> Any:
    """The trace's model whose modules the plan names (``plan["model"]``; the first in plans from
    before it was recorded)."""
    models = list(getattr(trace, "models", None) or [])
    return next((m for m in models if m.index == index), models[0] if models else None)


def shard_classes(trace: Any, config: PlanConfig, model_index: Any = None) -> tuple[str, ...]:
    """The classes of ``config.shard_modules`` in the trace's planned model, each once, in order: what
    accelerate and the HF Trainer wrap (``transformer_layer_cls_to_wrap``); empty when the trace does
    not name them."""
    model = _planned_model(trace, model_index)
    if model is None:
        return ()
    where = {name: i for i, name in enumerate(model.names)}
    found = [model.types[where[n]] for n in config.shard_modules if n in where]
    return tuple(dict.fromkeys(found))


def _plan_scaler(plan: dict[str, Any]) -> GradScalerSettings:
    """The planner's GradScaler settings (from the measured gradient ranges), else torch's defaults."""
    found = plan.get("grad_scaler") or {}
    if not found.get("init_scale") or not found.get("growth_interval"):
        return GradScalerSettings()
    return GradScalerSettings(float(found["init_scale"]), int(found["growth_interval"]))


def config_for_summary(trace: Any, summary: dict[str, Any]) -> PlanConfig | None:
    """The config of ``summary["plan"]``; None when the run has no plan (no budget, no memory figure)."""
    plan = summary.get("plan")
    if not plan:
        return None
    # the planner's own reading of the measured batch; imported here so that ``import memdoctor`` (which
    # the child running the user's script does) does not load the analysis
    from memdoctor.plan.measure import batch_size

    path = getattr(trace, "path", None)  # its file name only: a config must not carry the user's folders
    # a crashed run's plan is made from the salvaged ``.partial``, which is renamed to the trace's name
    path = None if path is None else Path(path).name.removesuffix(".partial")
    return from_plan(
        plan, trace=trace, trace_path=None if path is None else str(path), batch_size=batch_size(summary)
    )
