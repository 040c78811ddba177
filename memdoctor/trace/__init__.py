"""The trace: the one versioned file every stage after capture reads."""

from __future__ import annotations

from memdoctor.trace.format import (
    CATEGORIES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_NAME_CHARS,
    MAX_RECORD_CHARS,
    PARTIAL_SUFFIX,
    PHASES,
    TRACE_FILENAME,
    ModelInfo,
    StepRecord,
    Trace,
    TraceWriter,
    load_trace,
    make_header,
    read_trace,
    save_trace,
)

__all__ = [
    "CATEGORIES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_NAME_CHARS",
    "MAX_RECORD_CHARS",
    "PARTIAL_SUFFIX",
    "PHASES",
    "TRACE_FILENAME",
    "ModelInfo",
    "StepRecord",
    "Trace",
    "TraceWriter",
    "load_trace",
    "make_header",
    "read_trace",
    "save_trace",
]
