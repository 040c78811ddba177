"""The trace, the one contract between capture and every later stage: records, writer, reader, deep check.
Imports only the base modules; it stores figures and never interprets them (docs/architecture.md).
"""

from __future__ import annotations

from memdoctor.trace.reader import load_trace, paused_gc, read_trace
from memdoctor.trace.records import (
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
    event_record,
    make_end,
    make_header,
    run_settings,
    unfinished_end,
)
from memdoctor.trace.writer import TraceWriter, save_trace

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
    "event_record",
    "load_trace",
    "make_end",
    "make_header",
    "paused_gc",
    "read_trace",
    "run_settings",
    "save_trace",
    "unfinished_end",
]
