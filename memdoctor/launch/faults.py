"""How a profiled script's fault is recorded: what the step in progress measured, and the exception.

Shared by the supervised child (``memdoctor.launch.profile_child``) and the in-process profiler
(``memdoctor.api``), so that a trace says the same about an exception or an out-of-memory error
however the script was profiled.
"""

from __future__ import annotations

from typing import Any

from memdoctor.launch.script import user_frames
from memdoctor.units import MESSAGE_CHARS, clip


def close_session(session: Any) -> dict[str, Any]:
    """Record what the step in progress measured before the fault, and return where the script was."""
    where = session.where()
    if session._data.opt_posts and session._data.forwards:
        session.finish()
    else:
        session.flush_partial()
        session.stop()
    return where


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of memory: host (``MemoryError``) or device (torch's, by name
    or message, since each backend words it its own way)."""
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    text = str(exc).lower()
    return name == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most ``MESSAGE_CHARS`` characters (cut at a word): an
    event's message."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return clip(f"{type(exc).__name__}: {first}", MESSAGE_CHARS)


def exception_fields(exc: BaseException) -> dict[str, Any]:
    """An exception event's ``exception_type`` (qualified unless a builtin) and the script's own
    ``traceback`` frames."""
    module = type(exc).__module__
    qualname = type(exc).__qualname__
    return {
        "exception_type": qualname if module == "builtins" else f"{module}.{qualname}",
        "traceback": user_frames(exc),
    }
