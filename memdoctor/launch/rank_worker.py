"""One rank of ``memdoctor profile|run --nproc-per-node N``: the process ``torch.distributed.run``
starts as its worker, which supervises the user's script exactly as a one-process run does.

``profile``: ``memdoctor.launch.supervisor.run_profile`` into ``OUT/rank-K`` (K the global rank): the
same child, ProfileSession, steps, ``--timeout`` and budget, and the same trace, summary and report,
the trace's header saying which rank it is (``memdoctor.launch.rank_trace``). ``run``: the script to
its end with the plan applied (``memdoctor.launch.run.run_script``). The script inherits this process's
environment, torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
among it, and stays in this process's group, so torchrun's tear-down (SIGTERM to the group, then
SIGKILL) ends the script with its supervisor, and a supervisor that outlives it writes the outputs.

Before it exits the rank tells memdoctor how it ended (``ranklink``: status, exit codes, and when the
script ended, which orders the ranks by who failed first). Settings arrive in ``MEMDOCTOR_RANKS``,
removed before the script starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.launch import ranklink
from memdoctor.launch.childrun import STOP_SIGNALS
from memdoctor.launch.control import set_parent_death_signal
from memdoctor.launch.rank_trace import identity
from memdoctor.launch.ranks import ENV_VAR


def rank_folder(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}"


def main() -> int:
    cfg = json.loads(os.environ.pop(ENV_VAR))
    rank = identity(os.environ)
    if rank is None:
        print("memdoctor: error: started without torchrun's RANK and WORLD_SIZE", file=sys.stderr)
        return exitcodes.USAGE_ERROR
    set_parent_death_signal(signal.SIGTERM)  # the launcher gone: stop as on SIGTERM, keep what was measured
    link = ranklink.connect(cfg.get("socket"), {"rank": rank["rank"], "local_rank": rank["local_rank"]})
    with _noted_stops() as stops:
        try:
            result = _before_start(stops) or _supervise(cfg, rank)
        except KeyboardInterrupt:  # Ctrl-C outside the script's run (the supervisor handles it within)
            result = {"status": "interrupted", "exit_code": exitcodes.INTERRUPTED}
            result["message"] = "interrupted (Ctrl-C) while the rank's supervisor started or saved"
    result = {"rank": rank["rank"], "local_rank": rank["local_rank"], **result}
    result.setdefault("ended_unix", time.time())
    if link is not None:
        link.send_result(result)
    return int(result["exit_code"])


@contextlib.contextmanager
def _noted_stops() -> Iterator[list[int]]:
    """SIGTERM and SIGHUP are noted, not fatal, outside the script's run (where the supervisor
    handles them as a one-process run does): torchrun sends its tear-down SIGTERM whenever another
    rank fails, and a rank whose script has just ended must still write its trace and report."""
    noted: list[int] = []
    stops = [s for s in STOP_SIGNALS if s != signal.SIGINT]
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in stops}
    try:
        yield noted
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _before_start(stops: list[int]) -> dict[str, Any] | None:
    """Stopped before the script started (torchrun tore the job down while this rank started up)."""
    if not stops:
        return None
    name = signal.Signals(stops[0]).name
    message = f"stopped by {name} before the script started"
    result = {"status": "stopped", "exit_code": exitcodes.SIGNAL_BASE + stops[0], "signal": name}
    return {**result, "message": message}


def _supervise(cfg: dict[str, Any], rank: dict[str, Any]) -> dict[str, Any]:
    return _profile(cfg, rank) if cfg["mode"] == "profile" else _run(cfg)


def _profile(cfg: dict[str, Any], rank: dict[str, Any]) -> dict[str, Any]:
    from memdoctor.launch.supervisor import ProfileRequest, run_profile

    fields = cfg["request"]
    out_dir = rank_folder(Path(cfg["out_dir"]), rank["rank"])
    out_dir.mkdir(parents=True, exist_ok=True)
    request = ProfileRequest(**fields, out_dir=out_dir, distributed=rank)
    result = run_profile(request)
    end = result.end or {}
    return {
        "status": result.status,
        "exit_code": result.exit_code,
        "script_exit_code": end.get("exit_code"),
        "signal": end.get("signal"),
        "message": result.output_error or result.message,
        "ended_unix": result.ended_unix,
    }


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    from memdoctor.config import load_config
    from memdoctor.launch.run import run_script

    config = load_config(Path(cfg["config_path"]))
    code = run_script(config, cfg.get("script"), cfg.get("module"), list(cfg.get("args") or []))
    ended = time.time()
    name = _signal_name(code)
    if code == exitcodes.SCRIPT_OK:
        message = "the script finished"
    elif name:
        message = f"the script was stopped by {name}"
    else:
        message = f"the script exited with code {code}"
    return {
        "status": _run_status(code),
        "exit_code": code,
        "script_exit_code": code,
        "signal": name,
        "message": message,
        "ended_unix": ended,
    }


def _run_status(code: int) -> str:
    """A ``memdoctor run`` rank's status from the script's exit code (it writes no trace to say more)."""
    if code == exitcodes.SCRIPT_OK:
        return "completed"
    if code == exitcodes.INTERRUPTED:
        return "interrupted"
    if code > exitcodes.SIGNAL_BASE:
        return "killed"
    return "exception"


def _signal_name(code: int) -> str | None:
    """The signal an exit code of 128 + N names (a shell's convention, which ``run_script`` keeps)."""
    if code <= exitcodes.SIGNAL_BASE:
        return None
    try:
        return signal.Signals(code - exitcodes.SIGNAL_BASE).name
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
