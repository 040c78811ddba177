"""The process group memdoctor starts itself: ``parallel``'s, one per rank (``levers.parallel``), and
``full_offload``'s, a world of one process for FSDP2 (``levers.offload_full``).

Destroyed by its undo or at exit. Whether one was started in this process stays known after that
(``started_a_group``): gloo's worker threads outlive ``destroy_process_group`` while the wrapped model
refers to the group, and such a process leaves without the interpreter's teardown
(``memdoctor.launch.leave`` says why).
"""

from __future__ import annotations

import atexit
from typing import Any

import torch.distributed as dist

from memdoctor.patching import Undo

_STARTED = [False]


def start_own_group(backend: str, **kwargs: Any) -> Undo:
    """``dist.init_process_group(backend, **kwargs)``, destroyed by the undo returned or at exit."""
    dist.init_process_group(backend, **kwargs)
    _STARTED[0] = True

    def destroy() -> None:
        atexit.unregister(destroy)
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
    return destroy


def started_a_group() -> bool:
    """Whether memdoctor started a process group in this process (destroyed since or not)."""
    return _STARTED[0]


__all__ = ["start_own_group", "started_a_group"]
