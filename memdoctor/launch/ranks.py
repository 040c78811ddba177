"""Starting a multi-process job through torch's own launcher, and making sure all of it ends.

``memdoctor profile|run --nproc-per-node N`` starts ``torch.distributed.run`` (``rank_launcher``), whose
workers are memdoctor's rank supervisors (``rank_worker``): each runs the user's script as a one-process
``memdoctor profile`` or ``memdoctor run`` would, in the environment torchrun gives a worker (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a script written for ``torchrun``
runs unedited. torch does the rendezvous and the tear-down of the other ranks when one fails;
memdoctor writes none of its own.

This process waits for the launcher, with the ranks on a Unix socket (``ranklink``: why a socket):

- Ctrl-C, SIGTERM, SIGHUP: passed to every rank as the same stop a one-process run makes (the launcher
  runs in a session of its own, so the terminal's Ctrl-C reaches only memdoctor); a second one kills
  everything at once.
- ``--timeout``: each rank stops its own script when it expires, as one process does; if the job has
  not ended ``RANK_STOP_S`` later (a launcher stuck in its rendezvous), the ranks are sent SIGTERM, and
  everything is killed ``FORCE_KILL_S`` after that.
- At the end, every process group the job made (the launcher's, each rank's: its supervisor, the
  script, the script's own workers) is killed if anything in it is still alive, whatever happened
  before: no process outlives the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from memdoctor.launch.childrun import STOP_SIGNALS, TIMEOUT_GRACE_S
from memdoctor.launch.ranklink import RankLine, RankServer

ENV_VAR = "MEMDOCTOR_RANKS"  # the rank supervisors' settings (removed before the script runs)
RANK_STOP_S = TIMEOUT_GRACE_S + 45.0  # after --timeout: the ranks' own stop, outputs, and start-up
FORCE_KILL_S = TIMEOUT_GRACE_S + 30.0  # after a SIGTERM the job has not ended on: SIGKILL
DRAIN_S = TIMEOUT_GRACE_S + 30.0  # after the launcher: ranks still writing their outputs (launcher killed)
_POLL_S = 0.2


@dataclass(frozen=True)
class RankJob:
    """How many processes where: ``torch.distributed.run``'s own options, passed through."""

    nproc_per_node: int
    nnodes: str = "1"  # N, or MIN:MAX (elastic)
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def standalone(self) -> bool:
        """One node and no rendezvous address: torchrun's ``--standalone`` (a free port on this host,
        so two jobs on one machine never meet)."""
        single = self.nnodes in ("1", "1:1")
        return single and self.master_addr is None and self.master_port is None and self.node_rank is None

    @property
    def world_size(self) -> int:
        return int(self.nnodes.rpartition(":")[2]) * self.nproc_per_node

    def local_ranks(self) -> list[int]:
        """The global ranks this node runs (static rendezvous: node rank x processes per node)."""
        first = (self.node_rank or 0) * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node), "--nnodes", self.nnodes, "--max-restarts", "0"]
        if self.standalone:
            return [*args, "--standalone"]
        for flag, value in (
            ("--node-rank", self.node_rank),
            ("--master-addr", self.master_addr),
            ("--master-port", self.master_port),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args


@dataclass
class Launched:
    """How the job went, as this process saw it; each rank's own account is in ``lines``."""

    started_unix: float
    launcher_code: int
    lines: dict[int, RankLine] = field(default_factory=dict)  # by global rank, those that said hello
    signals: list[int] = field(default_factory=list)  # received by memdoctor while the job ran
    forced: bool = False  # the job outlived --timeout and was stopped from here
    stopped_unix: float | None = None  # when memdoctor stopped the job (a signal, or ``forced``)
    swept: int = 0  # process groups still alive at the end, killed


def launch(job: RankJob, worker_cfg: dict[str, Any], timeout_s: float | None) -> Launched:
    """Run the job to its end (see the module docstring); ``worker_cfg`` is each rank's settings."""
    server = RankServer()
    env = dict(os.environ)
    env[ENV_VAR] = json.dumps({**worker_cfg, "socket": str(server.path)})
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = [sys.executable, "-m", "memdoctor.launch.rank_launcher", *job.torchrun_args()]
    command += ["-m", "memdoctor.launch.rank_worker"]
    started = time.time()
    try:
        # a session of its own: the terminal's Ctrl-C reaches memdoctor only, which stops each rank the
        # way a one-process run stops; and its process group can be killed whole at the end
        proc = subprocess.Popen(command, env=env, start_new_session=True)
        launched = Launched(started_unix=started, launcher_code=0)
        with _noted_signals() as received:
            launched.launcher_code = _wait(proc, server, timeout_s, received, launched)
            _drain(server)
            launched.signals = list(received)
        launched.swept = _sweep(proc.pid, server)
        launched.lines = server.by_rank()
    finally:
        server.close()
    return launched


@contextlib.contextmanager
def _noted_signals() -> Iterator[list[int]]:
    """Ctrl-C, SIGTERM and SIGHUP only note the signal here; ``_wait`` acts on it."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(
    proc: subprocess.Popen[bytes],
    server: RankServer,
    timeout_s: float | None,
    received: list[int],
    launched: Launched,
) -> int:
    """The launcher's exit code, once it has ended; meanwhile the ranks' messages are read and the
    stops are passed on (see the module docstring)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s + RANK_STOP_S
    passed_on = 0
    forced_at: float | None = None
    while True:
        server.poll(_POLL_S)
        code = proc.poll()
        if code is not None:
            return code
        now = time.monotonic()
        if len(received) > passed_on:
            if passed_on == 0:
                launched.stopped_unix = launched.stopped_unix or time.time()
                server.broadcast({"signal": signal.Signals(received[0]).name})
            else:  # a second stop: at once
                _kill_all(proc.pid, server)
            passed_on = len(received)
        if deadline is not None and now >= deadline and forced_at is None:
            launched.forced, forced_at = True, now
            launched.stopped_unix = launched.stopped_unix or time.time()
            server.broadcast({"signal": "SIGTERM"})
        if forced_at is not None and now >= forced_at + FORCE_KILL_S:
            _kill_all(proc.pid, server)


def _drain(server: RankServer) -> None:
    """Read what the ranks still say: each has ended once the launcher has (it waits for its workers),
    unless the launcher itself was killed; then the ranks, told by the kernel, stop and write first."""
    limit = time.monotonic() + DRAIN_S
    while server.open_lines() and time.monotonic() < limit:
        server.poll(_POLL_S)


def _groups(launcher_pid: int, server: RankServer) -> list[int]:
    """The process groups of the job: the launcher's (it leads a session) and each rank's (torchrun
    starts each worker in a session of its own; the script and its workers stay in it)."""
    groups = [launcher_pid]
    for line in server.lines:
        pgid = line.hello.get("pgid")
        if isinstance(pgid, int) and pgid > 1 and pgid not in groups:
            groups.append(pgid)
    own = os.getpgid(0)
    return [g for g in groups if g != own]


def _kill_all(launcher_pid: int, server: RankServer) -> None:
    for group in _groups(launcher_pid, server):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def _sweep(launcher_pid: int, server: RankServer) -> int:
    """Kill whatever is still alive in the job's process groups; how many groups had something."""
    alive = 0
    for group in _groups(launcher_pid, server):
        try:
            os.killpg(group, signal.SIGKILL)
            alive += 1
        except (ProcessLookupError, PermissionError):
            continue
    return alive
