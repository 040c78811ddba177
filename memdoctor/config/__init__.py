"""``memdoctor.yaml``: the plan as a versioned file, and the same plan in other tools' terms."""

from __future__ import annotations

from memdoctor.config.file import (
    ATTENTION,
    CONFIG_FILENAME,
    CONFIG_VERSION,
    HEADER,
    MAX_CONFIG_BYTES,
    OPTIMIZERS,
    PADDING_POLICIES,
    PRECISIONS,
    DataLoaderSettings,
    GradScalerSettings,
    PlanConfig,
    Provenance,
    check_modules,
    config_for_summary,
    dump_config,
    from_plan,
    load_config,
    parse_config,
)

__all__ = [
    "ATTENTION",
    "CONFIG_FILENAME",
    "CONFIG_VERSION",
    "HEADER",
    "MAX_CONFIG_BYTES",
    "OPTIMIZERS",
    "PADDING_POLICIES",
    "PRECISIONS",
    "DataLoaderSettings",
    "GradScalerSettings",
    "PlanConfig",
    "Provenance",
    "check_modules",
    "config_for_summary",
    "dump_config",
    "from_plan",
    "load_config",
    "parse_config",
]
