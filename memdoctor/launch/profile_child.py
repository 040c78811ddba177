"""The supervised child: runs the user's script exactly as ``python train.py args`` would, profiled.

Started by the supervisor as ``python -m memdoctor.launch.profile_child`` with its settings in the environment
variable ``MEMDOCTOR_CHILD`` (removed before the script runs). It sets ``sys.argv``, ``sys.path[0]``
and ``__main__`` as Python does, installs a ``ProfileSession`` whose records go straight to the partial
trace file (one flushed gzip member each, so a hard crash keeps every finished step), and stops the
script with ``os._exit`` once the requested steps are recorded: the script's remaining code (its
checkpoint saving, its ``finally`` blocks) does not run, so memdoctor never causes writes to the user's
files beyond what the profiled steps themselves did.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import platform
import runpy
import signal
import sys
import time
import traceback
import types
from typing import Any

from memdoctor.errors import ConfigError
from memdoctor.exitcodes import INTERRUPTED

ENV_VAR = "MEMDOCTOR_CHILD"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # memdoctor/
EXIT_STOPPED = 0


def main() -> int:
    cfg = json.loads(os.environ.pop(ENV_VAR))
    _ctrl_c_raises()
    from memdoctor.capture.session import ProfileSession
    from memdoctor.device import default_device
    from memdoctor.trace import TraceWriter

    writer = TraceWriter(cfg["trace_path"])
    header_written: list[bool] = []
    installation = _install_config(cfg, writer, header_written)  # before CUDA starts (the allocator)
    device = default_device()
    collectors, header = start_run(cfg, device)
    writer.write(header)
    header_written.append(True)
    for line in installation.lines if installation is not None else []:
        writer.write(_event("config_applied", line, None))

    def stop() -> None:
        writer.write(_event("stopped", f"stopped after {session.steps_recorded} steps, as requested", None))
        writer.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)

    session = ProfileSession(
        steps=cfg["steps"],
        warmup=cfg["warmup"],
        sink=writer.write,
        device=device,
        on_done=stop,
        time_depth=cfg.get("time_depth"),
        detail=cfg.get("detail", "auto"),
        collectors=collectors,
    )
    code = _run(cfg, session, writer)
    writer.close()
    return code


def _install_config(cfg: dict[str, Any], writer: Any, header_written: list[bool]) -> Any:
    """``--config``: the plan installed as ``memdoctor run`` installs it (``memdoctor.levers.install``);
    each part applied later (when the script builds its optimizer) is an event ``config_applied``, and
    a part that cannot apply raises ``ConfigError`` into the script, recorded as its exception."""
    if not cfg.get("config"):
        return None
    from memdoctor.levers.install import install, say_stderr

    def say(line: str) -> None:
        say_stderr(line)
        if header_written:  # the earlier lines are written after the header
            writer.write(_event("config_applied", line, None))

    return install(cfg["config"], say=say)


def start_run(cfg: dict[str, Any], device: Any) -> tuple[list[Any], dict[str, Any]]:
    """Apply the memory cap, make the collectors and the trace header for a run described by ``cfg``
    (``command``, ``warmup``, ``steps``, ``budget_bytes``, ``collect``)."""
    import torch

    from memdoctor.capture.collectors import make_collectors
    from memdoctor.environment import recorded_environment
    from memdoctor.trace import make_header
    from memdoctor.version import __version__

    cap = device.apply_cap(cfg["budget_bytes"]) if cfg.get("budget_bytes") else None
    described = device.describe()
    described["memory_cap_bytes"] = cap
    collectors, unavailable = make_collectors(cfg.get("collect") or [], device=device)
    header = make_header(
        memdoctor_version=__version__,
        created_unix=time.time(),
        command=cfg["command"],
        settings={"warmup": cfg["warmup"], "steps": cfg["steps"], "budget_bytes": cfg.get("budget_bytes")},
        host={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        environment=recorded_environment(),
        device=described,
        not_measured=device.not_measured() + unavailable,
        collectors=[c.name for c in collectors],
        applied_config=cfg.get("config"),
    )
    return collectors, header


def _run(cfg: dict[str, Any], session: Any, writer: Any) -> int:
    _prepare_sys(cfg)
    session.start()
    try:
        if cfg.get("module"):
            runpy.run_module(cfg["module"], run_name="__main__", alter_sys=True)
        else:
            _run_script(cfg["script"])
    except SystemExit as exc:
        where = _close(session)
        code = _exit_code(exc.code)
        msg = f"the script called sys.exit({exc.code!r})"
        writer.write(_event("script_exit", msg, where, exit_code=code))
        return code
    except KeyboardInterrupt:
        # A second Ctrl-C, or the supervisor's own SIGINT to a child slow to stop, must not interrupt
        # the recording of what was measured; the supervisor kills the child if it is needed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        where = _close(session)
        writer.write(_event("interrupted", "interrupted (Ctrl-C)", where))
        writer.close()
        # Recorded and closed: leave now, as the requested-steps stop does, rather than wait at
        # interpreter exit for the script's non-daemon threads or atexit handlers to end.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    except ConfigError as exc:  # --config: a part of the plan cannot apply to this script
        where = _close(session)
        writer.write(_event("config_error", str(exc), where))
        print(f"memdoctor: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException as exc:  # the user's script failed: record it, show it, and exit non-zero
        where = _close(session)
        kind = "oom" if _is_oom(exc) else "exception"
        writer.write(_event(kind, _one_line(exc), where, exc=exc))
        traceback.print_exception(type(exc), exc, _user_tb(exc.__traceback__))
        return 1
    session.finish()
    writer.write(_event("script_finished", "the script finished", session.where()))
    return 0


def _ctrl_c_raises() -> None:
    """Make Ctrl-C raise ``KeyboardInterrupt`` here even if this process inherited SIGINT ignored.

    Python leaves SIGINT ignored when its parent ignored it (a process started from a shell's
    background job, or from a parent that ignores Ctrl-C while it waits); the supervisor always
    handles Ctrl-C, so the child must too, or Ctrl-C would leave the script running."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_script(script: str) -> None:
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


def _prepare_sys(cfg: dict[str, Any]) -> None:
    """Make sys look as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would."""
    if cfg.get("module"):
        sys.argv = [cfg["module"], *cfg["args"]]
        sys.path[0] = os.getcwd()
    else:
        script = os.path.abspath(cfg["script"])
        sys.argv = [cfg["script"], *cfg["args"]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))


def _close(session: Any) -> dict[str, Any]:
    """Record what the step in progress measured before the fault, and where the script was."""
    where = session.where()
    if session._data.opt_posts and session._data.forwards:
        session.finish()
    else:
        session.flush_partial()
        session.stop()
    return where


def _event(
    kind: str, message: str, where: dict[str, Any] | None, exc: BaseException | None = None, **extra: Any
) -> dict[str, Any]:
    rec: dict[str, Any] = {"type": "event", "kind": kind, "message": message, "t_unix": time.time()}
    rec.update(where or {})
    if exc is not None:
        module = type(exc).__module__
        rec["exception_type"] = (
            type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"
        )
        rec["traceback"] = _user_frames(exc)
    rec.update(extra)
    return rec


def _user_tb(tb: Any) -> Any:
    """The traceback from the script's first frame on, as ``python SCRIPT`` would print it."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if "memdoctor" not in name and "runpy" not in name and not name.startswith("<frozen "):
            break
        tb = tb.tb_next
    last = tb.tb_frame.f_code.co_filename if tb is not None else ""
    if last.startswith((_PACKAGE_DIR, "<frozen ")):
        return None  # raised while compiling the script (a syntax error): no frame of it to show
    return tb


def _user_frames(exc: BaseException, limit: int = 8) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in frames if "memdoctor" not in f.filename and "runpy" not in f.filename]
    return [line.rstrip() for line in traceback.format_list(keep[-limit:])]


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    text = str(exc).lower()
    return name == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:500]


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def _entry() -> None:
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the script started (importing torch): nothing measured
        code = INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    _entry()
