"""memdoctor.yaml: the plan as a versioned, schema-checked file, and the same plan in other tools' terms.
Imports plan (the lever vocabulary); applies nothing (docs/architecture.md, docs/config.md).
"""

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
    dump_config,
    load_config,
    parse_config,
)
from memdoctor.config.from_plan import config_for_summary, file_levers, from_plan

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
    "file_levers",
    "from_plan",
    "load_config",
    "parse_config",
]
