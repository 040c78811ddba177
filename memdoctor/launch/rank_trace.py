"""A rank's trace: which rank wrote it, and the process group's backend, which only the script knows.

The header is the first record, written before the script runs, so it can say the rank (from the
environment ``torch.distributed.run`` gives each worker) but not the backend: that exists once the
script calls ``init_process_group``. The child therefore writes one ``distributed`` event as soon as a
record follows the script's making of the default process group (``BackendWatchingWriter``), and the
rank's supervisor, which writes the final trace, puts that backend into the header's ``distributed``
(``rank_header``). Reading the group when it exists, rather than patching ``init_process_group``,
catches every way a script makes it (``init_process_group``, ``init_device_mesh``, accelerate, Lightning).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from memdoctor.trace import Trace, TraceWriter, event_record
from memdoctor.trace.records import distributed_info

EVENT_KIND = "distributed"


def identity(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The header's ``distributed`` for the process whose environment is ``env`` (the variables
    ``torch.distributed.run`` sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), backend not yet known; None outside a multi-process job."""
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    local = env.get("LOCAL_RANK", "")
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    return distributed_info(
        rank=rank,
        world_size=world,
        local_rank=int(local) if local.isdigit() else rank,
        master=f"{addr}:{port}" if addr and port else None,
    )


def rank_header(trace: Trace, rank: dict[str, Any]) -> dict[str, Any]:
    """``rank`` (``identity``'s) with the backend the child saw, for the final trace's header."""
    backend = next((e.get("backend") for e in trace.events if e.get("kind") == EVENT_KIND), None)
    return {**rank, "backend": backend if isinstance(backend, str) else None}


class BackendWatchingWriter(TraceWriter):
    """The child's trace writer in a rank: before each record, until it has seen one, it looks for the
    default process group and writes the ``distributed`` event naming its backend. A record is written
    at least once a step (and at every stop, fault and exit), so the backend is in the trace from the
    step after the script made the group; the look is two function calls, and stops once it is found."""

    backend: str | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.backend is None and record.get("type") != "header":
            backend = default_backend()
            if backend is not None:
                self.backend = backend
                message = f"the script made the default process group (backend {backend})"
                super().write(event_record(EVENT_KIND, message, backend=backend))
        super().write(record)


def default_backend() -> str | None:
    """The default process group's backend, or None while the script has made none (torch.distributed
    not imported, not available in this build, or not initialised)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return str(dist.get_backend())
    except Exception:  # a group being torn down, or a build without it: the backend is not known
        return None
