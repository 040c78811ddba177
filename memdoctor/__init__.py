"""memdoctor: one command on your unmodified training script -> what holds the GPU memory, layer by layer."""

from __future__ import annotations

__version__ = "0.1.0"

from memdoctor.api import profile
from memdoctor.errors import MemdoctorError, TraceError, UsageError
from memdoctor.trace import FORMAT_VERSION, Trace, load_trace

__all__ = [
    "FORMAT_VERSION",
    "MemdoctorError",
    "Trace",
    "TraceError",
    "UsageError",
    "__version__",
    "load_trace",
    "profile",
]
