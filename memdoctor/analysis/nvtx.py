"""What the report says about NVTX ranges: whether this run emitted them, and how to see them.

The ranges themselves live in an Nsight Systems capture, not in the trace; the trace's ``nvtx``
collector record only says whether a tool received them (see ``memdoctor.capture.nvtxranges``).
"""

from __future__ import annotations

from typing import Any

from memdoctor.trace import Trace

NSYS_COMMAND = "nsys profile -t cuda,nvtx memdoctor profile SCRIPT"


def report_note(trace: Trace) -> dict[str, Any] | None:
    """``{emitted, domain, version, command}`` for the report's note on NVTX; None when the run did
    not run the nvtx collector (``--collect`` left it out, or a trace from an earlier version)."""
    data = trace.collected.get("nvtx")
    if data is None:
        return None
    return {
        "emitted": data.get("emitted") is True,
        "domain": str(data.get("domain") or "memdoctor"),
        "version": data.get("version"),
        "command": NSYS_COMMAND,
    }
