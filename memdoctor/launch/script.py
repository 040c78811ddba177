"""Running the user's script as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would.

Both children use it: ``memdoctor profile``'s (``memdoctor.launch.profile_child``) and ``memdoctor
run``'s (``memdoctor.launch.run_child``). The script must not be able to tell it was started by
memdoctor: its ``__main__``, ``__file__``, ``sys.argv`` and ``sys.path[0]`` are Python's, its exit
code is the one Python would give, and its traceback starts at its own first frame.
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
import sys
import traceback
import types
from typing import Any

from memdoctor.exitcodes import SCRIPT_OK, SCRIPT_RAISED

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # memdoctor/


def prepare_sys(cfg: dict[str, Any]) -> None:
    """Make sys look as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would. ``argv_extra``:
    arguments a plan appends to the user's (``memdoctor.levers.scriptargs``, the ``--name=value`` form)."""
    args = [*cfg["args"], *cfg.get("argv_extra", ())]
    if cfg.get("module"):
        sys.argv = [cfg["module"], *args]
        sys.path[0] = os.getcwd()
    else:
        script = os.path.abspath(cfg["script"])
        sys.argv = [cfg["script"], *args]
        sys.path[0] = os.path.dirname(os.path.realpath(script))


def run_target(cfg: dict[str, Any]) -> None:
    """Run ``cfg``'s ``module`` (as ``python -m``) or else its ``script``, as ``__main__``."""
    if cfg.get("module"):
        runpy.run_module(str(cfg["module"]), run_name="__main__", alter_sys=True)
    else:
        run_script(str(cfg["script"]))


def run_script(script: str) -> None:
    """Run a script file as ``python SCRIPT`` does: ``__main__`` with an absolute ``__file__``,
    ``sys.argv[0]`` as the user typed it. (``runpy.run_path`` would set ``sys.argv[0]`` to the path it
    is given, so it cannot give both.)"""
    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)  # as python: no normpath
    with open(path, "rb") as fh:
        source = fh.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None)
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def exit_code(code: object) -> int:
    """The exit code Python gives for ``sys.exit(code)``: 0 for None, an integer as it is, else 1."""
    if code is None:
        return SCRIPT_OK
    if isinstance(code, int):
        return code
    return SCRIPT_RAISED


def user_tb(tb: Any) -> Any:
    """The traceback from the script's first frame on, as ``python SCRIPT`` would print it."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if "memdoctor" not in name and "runpy" not in name and not name.startswith("<frozen "):
            break
        tb = tb.tb_next
    last = tb.tb_frame.f_code.co_filename if tb is not None else ""
    if last.startswith((PACKAGE_DIR, "<frozen ")):
        return None  # raised while compiling the script (a syntax error): no frame of it to show
    return tb


def user_frames(exc: BaseException, limit: int = 8) -> list[str]:
    """The last ``limit`` frames of the script's own code (memdoctor's and runpy's left out), formatted."""
    frames = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in frames if "memdoctor" not in f.filename and "runpy" not in f.filename]
    return [line.rstrip() for line in traceback.format_list(keep[-limit:])]
