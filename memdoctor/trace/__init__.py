"""The trace: the one versioned file every stage after capture reads.

``records`` defines each record and its Python object, ``writer`` appends and saves, ``reader`` loads
and checks (``check`` is the deep check of every field a reader uses).
"""

from __future__ import annotations

from memdoctor.trace.reader import load_trace, read_trace
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
    "read_trace",
    "save_trace",
    "unfinished_end",
]
