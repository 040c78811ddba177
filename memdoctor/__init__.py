"""memdoctor: one command on your unmodified training script -> what holds the GPU memory, layer by layer."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from memdoctor.api import profile
from memdoctor.config import PlanConfig, load_config
from memdoctor.errors import ConfigError, MemdoctorError, TraceError, UsageError
from memdoctor.trace import FORMAT_VERSION, Trace, load_trace
from memdoctor.version import __version__

if TYPE_CHECKING:
    from memdoctor.frames import TraceFrames

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
    "load",
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


def load(path: str | os.PathLike[str], *, salvage: bool = False) -> TraceFrames:
    """Read a trace for notebooks and pipelines: its ledger, steps, timeline and findings as pandas
    DataFrames (``memdoctor.frames``, ``docs/notebook.md``).

    Imported on first use, like ``apply``: ``import memdoctor`` loads neither pandas nor the report.
    """
    from memdoctor.frames import load as _load

    return _load(path, salvage=salvage)
