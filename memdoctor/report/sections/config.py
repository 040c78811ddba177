"""The report's "Apply the plan" section: ``memdoctor.yaml`` and its exports, ready to copy.

Adds no ``summary.json`` key (the plan is already ``summary["plan"]``); the section only renders the
plan in the forms a user applies it in (docs/config.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from memdoctor.config import config_for_summary, dump_config
from memdoctor.config.export import (
    accelerate_kwargs,
    hf_training_arguments,
    lightning_trainer_kwargs,
    not_expressed,
    plain_loop_snippet,
)
from memdoctor.trace import Trace


def report_section(trace: Trace, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The config and its exports; None (the section says why) when the run has no plan."""
    config = config_for_summary(trace, summary)
    if config is None:
        return None
    # the trace's file name depends on where the trace was read from, not on the run: the report
    # (reproducible from any copy of the trace) leaves it out; the written memdoctor.yaml keeps it
    config = dataclasses.replace(config, provenance=dataclasses.replace(config.provenance, trace=None))
    exports = [
        ("HF TrainingArguments(**kwargs)", hf_training_arguments(config), not_expressed(config, "hf")),
        ("lightning.Trainer(**kwargs)", lightning_trainer_kwargs(config), not_expressed(config, "lightning")),
        ("accelerate.Accelerator(**kwargs)", accelerate_kwargs(config), not_expressed(config, "accelerate")),
    ]
    return {
        "yaml": dump_config(config),
        "fits": config.provenance.fits,
        # True: a --verify round measured this config fitting; False: none fitted; None: not verified
        "verified": (summary.get("plan") or {}).get("verified_fits"),
        "exports": [
            {"title": title, "text": json.dumps(kwargs, indent=2), "notes": notes}
            for title, kwargs, notes in exports
        ],
        "snippet": plain_loop_snippet(config, "memdoctor.yaml"),
    }
