"""memdoctor: one command on your unmodified training script -> what holds the GPU memory, layer by layer."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from memdoctor.api import profile
from memdoctor.config import PlanConfig, load_config
from memdoctor.errors import ConfigError, MemdoctorError, TraceError, UsageError
from memdoctor.trace import FORMAT_VERSION, Trace, load_trace

__all__ = [
    "FORMAT_VERSION",
    "ConfigError",
    "MemdoctorError",
    "PlanConfig",
    "Trace",
    "TraceError",
    "UsageError",
    "__version__",
    "apply",
    "load_config",
    "load_trace",
    "profile",
]


def apply(config: PlanConfig, model: Any, optimizer: Any = None, loader: Any = None) -> Any:
    """Apply a ``memdoctor.yaml`` plan to ``model`` in code (see ``memdoctor.config_apply``).

    Imported on first use, so ``import memdoctor`` (and the command line) does not load torch.
    """
    from memdoctor.config_apply import apply as _apply

    return _apply(config, model, optimizer, loader)
