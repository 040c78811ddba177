"""The exit codes of ``memdoctor``, one named constant each, documented in the README and ``--help``.

The supervisor maps how the user's script ended onto these; the CLI returns them.
"""

from __future__ import annotations

OK = 0  # the steps were profiled (or the script finished after at least one step)
INTERNAL_ERROR = 1  # a bug in memdoctor
USAGE_ERROR = 2  # bad command line, missing script, output folder refused, in use or full
TRACE_ERROR = 3  # a trace file that cannot be read
SCRIPT_FAILED = 4  # the script does not compile, raised, called sys.exit(non-zero), crashed or was killed
NO_STEPS = 5  # the script ended without any optimizer step
OUT_OF_MEMORY = 6  # the script ran out of memory (the trace keeps what was live)
LIMIT_EXCEEDED = 7  # memdoctor check: the peak (or step time) is over the given limit
TIMEOUT = 124  # --timeout expired; the script was stopped
INTERRUPTED = 130  # Ctrl-C
# memdoctor itself received SIGHUP (the terminal closed) or SIGTERM (timeout, Slurm, docker stop): the
# run was stopped and its outputs written; 128 + the signal's number, as a shell reports it
HANGUP = 129
TERMINATED = 143

# (code, meaning) in the order the README and `memdoctor profile --help` list them.
TABLE: tuple[tuple[int, str], ...] = (
    (OK, "the steps were profiled (or the script finished after at least one step)"),
    (INTERNAL_ERROR, "internal error in memdoctor (a bug: please report it with the trace)"),
    (
        USAGE_ERROR,
        "usage error: bad arguments, missing script, output folder refused or in use by another run; "
        "or the disk filled (what was kept is named)",
    ),
    (TRACE_ERROR, "unreadable trace: missing, corrupt, truncated or from a newer memdoctor"),
    (
        SCRIPT_FAILED,
        "the script failed: a syntax error, an exception, a non-zero sys.exit, a crash, or it was killed",
    ),
    (NO_STEPS, "the script ended without any optimizer step"),
    (OUT_OF_MEMORY, "the script ran out of memory"),
    (LIMIT_EXCEEDED, "memdoctor check: the peak memory or the step time is over the given limit"),
    (TIMEOUT, "--timeout expired"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
    (HANGUP, "memdoctor received SIGHUP (the terminal closed): the run was stopped, its outputs written"),
    (TERMINATED, "memdoctor received SIGTERM (timeout, Slurm, docker stop): stopped, outputs written"),
)


def describe() -> str:
    """The exit-code table as plain text lines, for ``--help`` epilogs."""
    return "\n".join(f"  {code:>3}  {meaning}" for code, meaning in TABLE)


# How ``python SCRIPT`` itself exits, which memdoctor's children give as the script would.
SCRIPT_OK = 0  # the script finished, or called sys.exit() / sys.exit(0)
SCRIPT_RAISED = 1  # an uncaught exception, or sys.exit with a message
SIGNAL_BASE = 128  # killed by signal N: the script's exit code is 128 + N, as a shell reports it
