"""Where memdoctor writes: choosing and creating output folders without overwriting a user's work.

The policy, in one place:

- ``memdoctor profile`` without ``-o`` writes into ``memdoctor-report`` in the current folder; when that
  exists and is not empty it takes the first free ``memdoctor-report-1``, ``memdoctor-report-2``, ...
  and says so. With ``--force`` it reuses ``memdoctor-report``.
- An explicit ``-o DIR`` that exists and is not empty is refused unless ``--force`` is given.
- ``memdoctor report TRACE`` without ``-o`` writes beside the trace, unless a ``report.html`` or
  ``summary.json`` is already there; then it takes the first free ``rerender-1``, ``rerender-2``, ...
  folder inside the trace's folder (``--force`` overwrites the two files beside the trace instead).
- Nothing is ever deleted. With ``--force`` memdoctor only overwrites the files it writes itself
  (``OWN_FILES``); anything else in the folder is left alone.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from memdoctor.errors import OutputError, UsageError

DEFAULT_DIRNAME = "memdoctor-report"
RERENDER_DIRNAME = "rerender"
REPORT_FILES = ("report.html", "summary.json")
OWN_FILES = ("trace.jsonl.gz", *REPORT_FILES)
_MAX_SUFFIX = 10_000


@dataclass(frozen=True)
class OutputDir:
    """A created, writable output folder, and a note for the terminal when it is not the one asked for."""

    path: Path
    note: str | None = None


def profile_output_dir(explicit: Path | None, *, force: bool, cwd: Path | None = None) -> OutputDir:
    """Resolve and create the folder ``memdoctor profile`` writes into (see the module docstring)."""
    if explicit is not None:
        return OutputDir(_explicit(explicit, force))
    base = (cwd or Path.cwd()) / DEFAULT_DIRNAME
    if force and (not base.exists() or base.is_dir()):
        return OutputDir(ensure_writable(base))
    path = _first_free(base, f"{DEFAULT_DIRNAME}-")
    if path == base:
        return OutputDir(path)
    return OutputDir(path, f"{display_path(base)} already exists; writing to {display_path(path)} instead")


def report_output_dir(trace_path: Path, explicit: Path | None, *, force: bool) -> OutputDir:
    """Resolve and create the folder ``memdoctor report`` writes into (see the module docstring)."""
    if explicit is not None:
        return OutputDir(_explicit(explicit, force))
    folder = trace_path.resolve().parent
    if force or not any((folder / name).exists() for name in REPORT_FILES):
        return OutputDir(ensure_writable(folder))
    path = _first_free(folder / f"{RERENDER_DIRNAME}-1", f"{RERENDER_DIRNAME}-", start=1)
    return OutputDir(
        path, f"{display_path(folder)} already has a report; writing to {display_path(path)} instead"
    )


def is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and next(path.iterdir(), None) is None
    except OSError:
        return False


def ensure_writable(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and check that a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputError(
            f"{path}: cannot write the output folder ({reason}); choose another with -o"
        ) from None
    return path


def _explicit(path: Path, force: bool) -> Path:
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path}: exists and is not a folder; choose another output folder with -o")
    if path.is_dir() and not is_empty_dir(path) and not force:
        raise UsageError(
            f"{path}: output folder already exists and is not empty; choose another with -o, or pass "
            f"--force to write into it (memdoctor only overwrites its own {', '.join(OWN_FILES)})"
        )
    return ensure_writable(path)


def _first_free(base: Path, prefix: str, start: int = 0) -> Path:
    """The first of ``base``, ``<prefix>1``, ``<prefix>2``, ... that we could claim (new or empty)."""
    for n in range(start, _MAX_SUFFIX):
        candidate = base if n == start else base.with_name(f"{prefix}{n}")
        if _claim(candidate):
            return ensure_writable(candidate)
    raise OutputError(f"{base.parent}: no free output folder name after {prefix}{_MAX_SUFFIX - 1}; use -o")


def _claim(path: Path) -> bool:
    """Create ``path`` atomically, or accept it if it is an empty folder; False if it is taken."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        return True
    except FileExistsError:
        return is_empty_dir(path)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputError(
            f"{path}: cannot create the output folder ({reason}); choose another with -o"
        ) from None


def display_path(path: Path) -> str:
    """A path relative to the current folder when it is inside it, else as is."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def round_folder(out_dir: Path, stem: str, k: int) -> Path:
    """The writable folder of round ``k`` of a loop of profiles inside the report folder ``out_dir``:
    ``OUT/stem`` for round 1, ``OUT/stem-k`` after (``--verify``'s rounds, ``--reprofile``'s runs),
    never over the first run's files."""
    return ensure_writable(out_dir / (stem if k == 1 else f"{stem}-{k}"))
