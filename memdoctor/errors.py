"""memdoctor's one error hierarchy.

Errors are raised anywhere and caught only at the edge (``memdoctor.cli.main``), where they are printed
as one line, without a traceback, and turned into the exit code they carry.
"""

from __future__ import annotations

from memdoctor.exitcodes import SCRIPT_FAILED, TRACE_ERROR, USAGE_ERROR


class MemdoctorError(Exception):
    """Base class of every error memdoctor reports to a user."""

    exit_code = USAGE_ERROR


class UsageError(MemdoctorError):
    """Bad command-line input: a missing script, an unparseable size, an existing output folder."""

    exit_code = USAGE_ERROR


class TraceError(MemdoctorError):
    """A trace file that cannot be read: missing, corrupt, truncated, or from a newer memdoctor."""

    exit_code = TRACE_ERROR


class OutputError(MemdoctorError):
    """An output location that cannot be written."""

    exit_code = USAGE_ERROR


class ScriptError(MemdoctorError):
    """The user's script cannot run at all (it does not compile): found before profiling starts."""

    exit_code = SCRIPT_FAILED


class ConfigError(MemdoctorError):
    """A ``memdoctor.yaml`` that cannot be used: not YAML, a YAML tag, an unknown key, a wrong type, a
    newer version, a module name the model lacks, or a part of the plan that cannot be applied."""

    exit_code = USAGE_ERROR
