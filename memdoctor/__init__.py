"""memdoctor: one command on your unmodified training script -> what holds the GPU memory, layer by layer."""

from __future__ import annotations

from typing import Any

from memdoctor.api import profile
from memdoctor.config import PlanConfig, load_config
from memdoctor.errors import ConfigError, MemdoctorError, TraceError, UsageError
from memdoctor.trace import FORMAT_VERSION, Trace, load_trace
from memdoctor.version import __version__

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
    """Apply a ``memdoctor.yaml`` plan to ``model`` in code (see ``memdoctor.levers.apply``).

    Imported on first use, so ``import memdoctor`` (and the command line) does not load torch.
    """
    from memdoctor.levers.apply import apply as _apply

    return _apply(config, model, optimizer, loader)
