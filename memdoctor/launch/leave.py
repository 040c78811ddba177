"""Leaving a process whose process group memdoctor started (``parallel``'s rank, ``full_offload``'s world of
one; ``memdoctor.levers.owngroup``), without the interpreter's teardown.

Why: the group outlives ``destroy_process_group`` (the model memdoctor wrapped still refers to it), so
gloo's worker threads are alive while Python finalizes. A worker that is still releasing its last
collective when the teardown's garbage collection runs takes the GIL, CPython ends that thread from
inside a C++ destructor, and the rank aborts after the script finished: "terminate called without an
active exception", SIGABRT, exit -6 (1 run in 10 on 2 loaded cores: tests/test_parallel_apply.py in CI;
the core showed ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop`` under ``Py_FinalizeEx``'s
collection; pytorch/pytorch#190489, #179291). A barrier before destroying the group did not prevent it.

So a finished rank does what Python's exit does that a script can rely on, in Python's order (its
non-daemon threads joined, its ``atexit`` handlers run, memdoctor's destroying the group among them, its
open files' buffers and the standard streams flushed) and then ends with ``os._exit``. Skipped: only the
teardown's last collection, whose ``__del__`` calls the language does not promise ("It is not guaranteed
that __del__() methods are called for objects that still exist when the interpreter exits", the data
model). ``atexit._run_exitfuncs`` is CPython's own and private: without it the rank exits as Python does.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading


def leave(code: int) -> None:
    """End this process now with ``code``, after the exit steps a script relies on; returns (and lets
    Python exit as usual) only where this Python cannot run the ``atexit`` handlers itself."""
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:
        return
    for thread in threading.enumerate():  # as threading._shutdown does, before the atexit handlers
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    run_exitfuncs()
    flush_open_files()
    os._exit(code)


def flush_open_files() -> None:
    """Write out every open, writable file object's buffer: text layers first, so what they hold reaches
    the binary buffers below them, then those. Errors are the file's own and are not raised here."""
    # by type, not isinstance: an object's own __class__ (a deprecated proxy's) may warn when read
    streams = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase)]
    for kind in (io.TextIOBase, io.BufferedIOBase):
        for stream in streams:
            if issubclass(type(stream), kind):
                with contextlib.suppress(Exception):
                    if not stream.closed and stream.writable():
                        stream.flush()
    for std in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            std.flush()


__all__ = ["flush_open_files", "leave"]
