"""The script (or ``-m MODULE``) that ``profile`` and ``run`` start: its arguments, and the checks that
refuse, in one line and before any child starts, what ``python SCRIPT`` could not run."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor.cli.arguments import PROG
from memdoctor.cli.terminal import one_line
from memdoctor.errors import ScriptError, UsageError

_EXECUTABLE_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
_PYTHON_BINARY_SUFFIXES = (".pyc", ".pyz", ".zip")


def add_script_arguments(p: argparse.ArgumentParser, usage: str, epilog: str) -> None:
    """What ``profile`` and ``run`` share: their help layout and the script (or ``-m MODULE``) to run."""
    p.usage, p.epilog = usage, epilog
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script, run as `python SCRIPT`")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module instead, as `python -m MODULE`")


def check_target(ns: argparse.Namespace, command: str) -> None:
    """The script or module ``command`` was given, checked; a usage error when it was given neither."""
    if ns.module is not None:
        check_module_name(ns.module)
    elif ns.script is not None:
        check_script(Path(ns.script))
    else:
        raise UsageError(
            f"give the script to {command} ({PROG} {command} train.py) or a module with -m MODULE"
        )


def check_script(path: Path) -> None:
    """Refuse, with a clear message, what ``python SCRIPT`` could not run as a training script."""
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: is a folder, not a script; give the training script, or use -m MODULE")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file")
    try:
        with path.open("rb") as fh:
            head = fh.read(8192)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if head.startswith(_EXECUTABLE_MAGIC):
        raise UsageError(f"{path}: is a compiled program, not a Python script; memdoctor runs Python scripts")
    if b"\0" in head and path.suffix not in _PYTHON_BINARY_SUFFIXES:
        raise UsageError(f"{path}: looks like a binary file, not a Python script")
    first = head.split(b"\n", 1)[0]
    if first.startswith(b"#!") and b"python" not in first:
        interpreter = first[2:].decode(errors="replace").strip()
        raise UsageError(
            f"{path}: is a script for {interpreter!r}, not Python; profile the Python script it runs instead"
        )
    if path.suffix == ".ipynb" or (head.lstrip().startswith(b"{") and b'"cells"' in head):
        # JSON is almost valid Python: run as a script, a notebook would fail in confusing ways.
        raise UsageError(
            f"{path}: is a Jupyter notebook, not a script; export it first "
            f"(jupyter nbconvert --to script {path.name}) and profile the .py file"
        )
    if path.suffix not in _PYTHON_BINARY_SUFFIXES:
        check_syntax(path)


def check_syntax(path: Path) -> None:
    """Compile the script here (nothing runs) so that a syntax error is one line and costs no
    profiling run: the child would only start torch to fail the same way."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError too
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise ScriptError(
            f"{where}: {type(exc).__name__}: {exc.msg}; the script does not compile, nothing was run"
        ) from None
    except (ValueError, OSError) as exc:  # null bytes, unreadable
        raise UsageError(f"{path}: cannot compile it as Python ({one_line(exc)})") from None


def check_module_name(name: str) -> None:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"{name!r} is not a module name; -m takes a dotted name such as mypackage.train")
