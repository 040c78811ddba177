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
- Files are written whole (``atomic_write``: a temp file beside the target, then ``os.replace``) with
  the mode a plain ``open()`` would give them, ``0o666`` less the user's umask (``file_mode``), so a CI
  artefact or a shared folder can serve them (a bare ``mkstemp`` would leave them ``0o600``).
- One run, one folder: a profile holds its folder (``FolderClaim``: an exclusive lock on
  ``LOCK_NAME`` inside it) from the moment it chooses it until its last file is written. A second run
  is refused with one line naming the holder (``-o DIR``, ``--force`` too), or, without ``-o``, takes
  the next free ``memdoctor-report-N``. The lock is the operating system's (``flock``), so a holder that
  died (``kill -9``) holds nothing: its folder is free again, with no stale lock to clear by hand.
  ``memdoctor report`` claims the folder it writes into the same way, so it never writes its two files
  into a folder a running profile holds (refused in one line, exit code 2).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memdoctor.errors import OutputError, UsageError

try:
    import fcntl
except ImportError:  # Windows: an O_EXCL marker instead (FolderClaim)
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".memdoctor.lock"  # held while a run writes into its folder; removed when it ends
DEFAULT_DIRNAME = "memdoctor-report"
RERENDER_DIRNAME = "rerender"
REPORT_FILES = ("report.html", "summary.json")
OWN_FILES = ("trace.jsonl.gz", *REPORT_FILES)
_MAX_SUFFIX = 10_000


class FolderHeld(Exception):
    """The folder is claimed by a live run; ``holder`` says which (pid, host, start, command)."""

    def __init__(self, holder: dict[str, Any]) -> None:
        super().__init__(holder)
        self.holder = holder


class FolderClaim:
    """This run's hold on its output folder: an exclusive ``flock`` on ``LOCK_NAME``, whose content
    (pid, host, start time, command) names the run to a second one. Released (and the file removed) by
    ``release`` or at the end of a ``with`` block; the kernel releases it if the process dies."""

    def __init__(self, folder: Path, command: str = "profile") -> None:
        self.folder = folder
        self.lock = folder / LOCK_NAME
        self._fd: int | None = _lock(self.lock, command)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # remove it while still holding it: a waiting run then re-checks the file it locked
            if _same_file(self.lock, fd):
                self.lock.unlink()
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> FolderClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(lock: Path, command: str) -> int:
    """An exclusive, held lock on ``lock`` with our details written in; FolderHeld if a live run has it."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time(), "command": command}
    while True:
        if fcntl is None:
            fd = _exclusive_marker(lock)
        else:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(fd)
                os.close(fd)
                raise FolderHeld(holder) from None
            if not _same_file(lock, fd):  # the holder removed it as we locked it: lock the new one
                os.close(fd)
                continue
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(me).encode())
        return fd


def _exclusive_marker(lock: Path) -> int:
    """Without ``flock``: create the marker exclusively; one naming a process that no longer runs on
    this host is stale and is replaced."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        fd = os.open(lock, os.O_RDONLY)
        holder = _read_holder(fd)
        os.close(fd)
        if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
            lock.unlink(missing_ok=True)
            return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        raise FolderHeld(holder) from None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def held_message(folder: Path, holder: dict[str, Any]) -> str:
    """``DIR: in use by memdoctor profile (pid 123 on host, started 16:40:02 UTC); ...``"""
    who = f"memdoctor {holder.get('command') or 'run'}"
    details = []
    if holder.get("pid"):
        details.append(f"pid {holder['pid']}" + (f" on {holder['host']}" if holder.get("host") else ""))
    if isinstance(holder.get("started_unix"), (int, float)):
        details.append(
            "started " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["started_unix"]))
        )
    if details:
        who += f" ({', '.join(details)})"
    return f"{folder}: in use by {who}; wait for it to end, or choose another output folder with -o"


@dataclass(frozen=True)
class OutputDir:
    """A created, writable output folder, and a note for the terminal when it is not the one asked for.
    ``claim`` holds the folder for this run: release it (``with out.claim``) once the last file is written."""

    path: Path
    note: str | None = None
    claim: FolderClaim | None = None

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()


def profile_output_dir(explicit: Path | None, *, force: bool, cwd: Path | None = None) -> OutputDir:
    """Resolve, create and claim the folder ``memdoctor profile`` writes into (see the module docstring)."""
    if explicit is not None:
        if explicit.is_dir() and _held(explicit):  # "in use", before "not empty": it names the run
            _claim_or_refuse(explicit, force).release()
        path = _explicit(explicit, force)
        return OutputDir(path, claim=_claim_or_refuse(path, force))
    base = (cwd or Path.cwd()) / DEFAULT_DIRNAME
    if force and (not base.exists() or base.is_dir()):
        path = ensure_writable(base)
        return OutputDir(path, claim=_claim_or_refuse(path, force))
    path, claim = _first_free(base, f"{DEFAULT_DIRNAME}-")
    if path == base:
        return OutputDir(path, claim=claim)
    why = "is in use by another memdoctor run" if _held(base) else "already exists"
    note = f"{display_path(base)} {why}; writing to {display_path(path)} instead"
    return OutputDir(path, note, claim)


def _claim_or_refuse(path: Path, force: bool, command: str = "profile") -> FolderClaim:
    """Claim an explicit (or forced) folder; a live holder, or a folder that filled meanwhile, is refused."""
    try:
        claim = FolderClaim(path, command)
    except FolderHeld as held:
        raise UsageError(held_message(path, held.holder)) from None
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the output folder ({exc.strerror or exc})") from None
    if not force and not is_empty_dir(path):  # another run wrote here between our check and the claim
        claim.release()
        _explicit(path, force)
    return claim


def _held(path: Path) -> bool:
    """Whether a live run holds ``path`` (a folder that is there)."""
    if not (path / LOCK_NAME).exists():
        return False
    try:
        FolderClaim(path).release()
    except FolderHeld:
        return True
    except OSError:
        return False
    return False


def report_output_dir(trace_path: Path, explicit: Path | None, *, force: bool) -> OutputDir:
    """Resolve, create and claim the folder ``memdoctor report`` writes into (see the module docstring).
    The claim (release it once both files are written) keeps a re-render out of a folder that a running
    profile holds: a live holder is refused with one line naming it (a ``UsageError``, exit code 2)."""
    if explicit is not None:
        if explicit.is_dir() and _held(explicit):  # "in use", before "not empty": it names the run
            _claim_or_refuse(explicit, force, "report").release()
        path = _explicit(explicit, force)
        return OutputDir(path, claim=_claim_or_refuse(path, force, "report"))
    folder = trace_path.resolve().parent
    if force or not any((folder / name).exists() for name in REPORT_FILES):
        # Beside the trace: a folder that holds files already (the trace), so only a live run is refused.
        return OutputDir(ensure_writable(folder), claim=_claim_or_refuse(folder, True, "report"))
    path, claim = _first_free(
        folder / f"{RERENDER_DIRNAME}-1", f"{RERENDER_DIRNAME}-", start=1, command="report"
    )
    note = f"{display_path(folder)} already has a report; writing to {display_path(path)} instead"
    return OutputDir(path, note, claim)


def is_empty_dir(path: Path, *, ignore_lock: bool = True) -> bool:
    """A folder with nothing in it (a lock file alone, of a run that holds it or died, counts as empty
    unless ``ignore_lock`` is False)."""
    try:
        return path.is_dir() and all(ignore_lock and p.name == LOCK_NAME for p in path.iterdir())
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


def _first_free(
    base: Path, prefix: str, start: int = 0, command: str = "profile"
) -> tuple[Path, FolderClaim]:
    """The first of ``base``, ``<prefix>1``, ``<prefix>2``, ... that we could claim (new or empty, and
    held by no other run), claimed."""
    for n in range(start, _MAX_SUFFIX):
        candidate = base if n == start else base.with_name(f"{prefix}{n}")
        if not _claim(candidate):
            continue
        ensure_writable(candidate)
        try:
            claim = FolderClaim(candidate, command)
        except FolderHeld:
            continue
        except OSError:
            continue
        if is_empty_dir(candidate):  # still empty now that it is ours: no run wrote here meanwhile
            return candidate, claim
        claim.release()
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


def file_mode() -> int:
    """The mode a new file gets from a plain ``open()``: ``0o666`` less the process's umask.

    Read from ``/proc/self/status`` where Linux has it, because the portable way (``os.umask`` set and
    set back) leaves the umask at 0 for a moment, process-wide: a file another thread of the user's
    script creates in that moment would be world-writable."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the fallback: briefly the strictest mask, never 0
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) via a temp file in the same folder and ``os.replace``, so a reader
    never sees half a file, with the user's normal permissions (``file_mode``); an ``OutputError``
    naming the file when it cannot be written."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; check the output folder") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
