"""The environment variables a trace may record: an explicit allow-list, in this one place.

The environment of a training run holds secrets (``HF_TOKEN``, ``WANDB_API_KEY``, cloud keys), and a
trace is a file people attach to bug reports. So memdoctor records no environment variable except the
few below, which change what a run measures: which GPU it ran on, how the CUDA caching allocator
behaved, whether kernel launches were synchronous, how many CPU threads ran. Their values are settings,
not credentials. Adding a name here is a deliberate, reviewed act; ``docs/trace-format.md`` lists them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ALLOWED: tuple[str, ...] = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_MODULE_LOADING",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "OMP_NUM_THREADS",
)
MAX_VALUE_CHARS = 256


def recorded_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowed variables that are set, by name (values cut to ``MAX_VALUE_CHARS``)."""
    env = os.environ if environ is None else environ
    return {name: env[name][:MAX_VALUE_CHARS] for name in ALLOWED if name in env}
