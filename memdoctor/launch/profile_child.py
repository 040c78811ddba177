"""The supervised child: runs the user's script exactly as ``python train.py args`` would, profiled.

Started by the supervisor as ``python -m memdoctor.launch.profile_child`` with its settings in the environment
variable ``MEMDOCTOR_CHILD`` (removed before the script runs). It sets ``sys.argv``, ``sys.path[0]``
and ``__main__`` as Python does (``memdoctor.launch.script``), installs a ``ProfileSession`` whose
records go straight to the partial trace file (one flushed gzip member each, so a hard crash keeps
every finished step), and stops the script with ``os._exit`` once the requested steps are recorded:
the script's remaining code (its checkpoint saving, its ``finally`` blocks) does not run, so memdoctor
never causes writes to the user's files beyond what the profiled steps themselves did.

A trace write that fails (a full disk) stops recording and then the script, the same way: memdoctor's
own I/O error never raises into the script, the supervisor is told over the control socket
(``memdoctor.launch.control``), and the records flushed before it stay salvageable. Stopping rather
than letting the script run on unrecorded, because the run's only purpose under ``memdoctor profile``
is its measurement, and a GPU left training for nothing is the costlier surprise.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import sys
import time
import traceback
from typing import Any

from memdoctor.errors import ConfigError
from memdoctor.exitcodes import INTERRUPTED, SCRIPT_OK, SCRIPT_RAISED
from memdoctor.launch.control import ChildControl, child_control
from memdoctor.launch.faults import close_session, exception_fields, is_oom, one_line
from memdoctor.launch.leave import leave
from memdoctor.launch.rank_trace import BackendWatchingWriter
from memdoctor.launch.script import exit_code, prepare_sys, run_target, user_tb
from memdoctor.patching import wrap_attr
from memdoctor.trace import TraceWriter, event_record, make_header, run_settings
from memdoctor.trace.redact import redact_text, secret_values

ENV_VAR = "MEMDOCTOR_CHILD"
WRITE_FAILED = 75  # the exit code after a failed trace write (EX_TEMPFAIL); the supervisor is told why
_control: ChildControl | None = None


def main() -> int:
    global _control
    cfg = json.loads(os.environ.pop(ENV_VAR))
    _ctrl_c_raises()
    _control = child_control()
    from memdoctor.capture.session import ProfileSession

    # one rank of a multi-process job: the trace also says the process group's backend (rank_trace)
    writer_class = BackendWatchingWriter if cfg.get("distributed") else TraceWriter
    writer = writer_class(cfg["trace_path"], on_error=_write_failed)
    header_written: list[bool] = []
    sessions: list[Any] = []  # the session, once made: checkpointed saves are shown to its ledger
    installation = _install_config(cfg, writer, header_written, sessions)  # before CUDA starts
    device = _device(cfg)
    collectors, header = start_run(cfg, device)
    writer.write(header)
    header_written.append(True)
    for line in installation.lines if installation is not None else []:
        writer.write(event_record("config_applied", line))

    def stop() -> None:
        writer.write(event_record("stopped", f"stopped after {session.steps_recorded} steps, as requested"))
        writer.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(SCRIPT_OK)

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
    sessions.append(session)
    extra = installation.argv_args() if installation is not None else []
    code = _run({**cfg, "argv_extra": extra}, session, writer)
    writer.close()
    from memdoctor.levers.owngroup import started_a_group

    if started_a_group():  # parallel's or full_offload's: as memdoctor run's child (launch/leave.py)
        leave(code)
    return code


def _device(cfg: dict[str, Any]) -> Any:
    """The device to measure: the script's. A rank of a job on GPUs trains on ``cuda:LOCAL_RANK`` by
    torchrun's convention (each rank's ``set_device(local_rank)``), not on the current device, which is
    0 in every rank until the script sets it; with one visible GPU per rank, on that one."""
    from memdoctor.device import CudaDevice, default_device

    device = default_device()
    rank = cfg.get("distributed")
    if isinstance(device, CudaDevice) and rank:
        import torch

        return CudaDevice(index=int(rank["local_rank"]) % max(1, torch.cuda.device_count()))
    return device


def _install_config(cfg: dict[str, Any], writer: Any, header_written: list[bool], sessions: list[Any]) -> Any:
    """``--config``: the plan installed as ``memdoctor run`` installs it (``memdoctor.levers.install``);
    each part applied later (when the script builds its optimizer) is an event ``config_applied``, and
    a part that cannot apply raises ``ConfigError`` into the script, recorded as its exception. With
    ``see_checkpointed`` (the checkpoint-all re-profile), what checkpointed modules save is counted by
    the session's ledger as if they were not checkpointed (``ProfileSession.see_saved``)."""
    if not cfg.get("config"):
        return None
    from memdoctor.levers.install import install, say_stderr

    def say(line: str) -> None:
        say_stderr(line)
        if header_written:  # the earlier lines are written after the header
            writer.write(event_record("config_applied", line))

    def see(tensor: Any) -> None:
        if sessions:
            sessions[0].see_saved(tensor)

    return install(cfg["config"], say=say, see_saved=see if cfg.get("see_checkpointed") else None)


def start_run(cfg: dict[str, Any], device: Any) -> tuple[list[Any], dict[str, Any]]:
    """Apply the memory cap, make the collectors and the trace header for a run described by ``cfg``
    (``command``, ``warmup``, ``steps``, ``budget_bytes``, ``collect``)."""
    import torch

    from memdoctor.capture.collectors import make_collectors
    from memdoctor.environment import recorded_environment
    from memdoctor.version import __version__

    cap = device.apply_cap(cfg["budget_bytes"]) if cfg.get("budget_bytes") else None
    described = device.describe()
    described["memory_cap_bytes"] = cap
    collectors, unavailable = make_collectors(cfg.get("collect") or [], device=device)
    header = make_header(
        memdoctor_version=__version__,
        created_unix=time.time(),
        command=cfg["command"],
        settings=run_settings(cfg["warmup"], cfg["steps"], cfg.get("budget_bytes"), cfg.get("gpu")),
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
    if cfg.get("distributed"):  # one rank of a torch.distributed.run job (memdoctor.launch.rank_trace)
        header["distributed"] = cfg["distributed"]
    return collectors, header


def _count_processes(started: list[int]) -> Any:
    """Count the processes the script starts (``multiprocessing``, ``torch.multiprocessing``): training
    that runs in one of them is not profiled (the hooks live in this process), and a run that found no
    step says so rather than only "no training step"."""
    import multiprocessing.process

    def make(start: Any) -> Any:
        def counted(self: Any) -> Any:
            started[0] += 1
            return start(self)

        return counted

    return wrap_attr(multiprocessing.process.BaseProcess, "start", make)


def _run(cfg: dict[str, Any], session: Any, writer: Any) -> int:
    prepare_sys(cfg)
    session.start()
    started = [0]
    undo_count = _count_processes(started)
    try:
        run_target(cfg)
    except SystemExit as exc:
        where = close_session(session)
        code = exit_code(exc.code)
        msg = f"the script called sys.exit({exc.code!r})"
        writer.write(event_record("script_exit", msg, where, exit_code=code))
        return code
    except KeyboardInterrupt:
        # A second Ctrl-C, or the supervisor's own SIGINT to a child slow to stop, must not interrupt
        # the recording of what was measured; the supervisor kills the child if it is needed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        reason = _control.stop_reason() if _control is not None else "interrupted (Ctrl-C)"
        where = close_session(session)
        writer.write(event_record("interrupted", reason, where))
        writer.close()
        # Recorded and closed: leave now, as the requested-steps stop does, rather than wait at
        # interpreter exit for the script's non-daemon threads or atexit handlers to end.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    except ConfigError as exc:  # --config: a part of the plan cannot apply to this script
        where = close_session(session)
        writer.write(event_record("config_error", str(exc), where))
        print(f"memdoctor: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException as exc:  # the user's script failed: record it, show it, and exit non-zero
        where = close_session(session)
        kind = "oom" if is_oom(exc) else "exception"
        writer.write(event_record(kind, one_line(exc), where, **exception_fields(exc)))
        shown = "".join(traceback.format_exception(type(exc), exc, user_tb(exc.__traceback__)))
        print(redact_text(shown, secret_values()), end="", file=sys.stderr, flush=True)  # as the trace has it
        return SCRIPT_RAISED
    finally:
        undo_count()
    session.finish()
    finished = event_record("script_finished", "the script finished", session.where())
    writer.write({**finished, "processes_started": started[0]} if started[0] else finished)
    return SCRIPT_OK


def _write_failed(exc: OSError) -> None:
    """A trace write failed (``TraceWriter``'s ``on_error``, called inside the script's own calls):
    tell the supervisor, say it in one line, and stop the script here without raising into it."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    told = _control is not None and _control.send(
        {"write_failed": {"errno": exc.errno, "reason": reason, "path": exc.filename}}
    )
    if not told:  # no supervisor to say it better
        print(f"memdoctor: error: cannot write the trace ({reason}); recording stopped", file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(WRITE_FAILED)


def _ctrl_c_raises() -> None:
    """Make Ctrl-C raise ``KeyboardInterrupt`` here even if this process inherited SIGINT ignored.

    Python leaves SIGINT ignored when its parent ignored it (a process started from a shell's
    background job, or from a parent that ignores Ctrl-C while it waits); the supervisor always
    handles Ctrl-C, so the child must too, or Ctrl-C would leave the script running."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _entry() -> None:
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the script started (importing torch): nothing measured
        code = INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    _entry()
