"""The line between the supervisor and its child: why the child is asked to stop, what went wrong in it,
and the child noticing that memdoctor itself is gone.

A ``socket.socketpair``: the supervisor keeps one end, the child inherits the other (its number in
``MEMDOCTOR_CONTROL``). Each message is one JSON line.

- supervisor -> child: ``{"stop": REASON}``. The child's watcher thread keeps the reason and raises
  SIGINT in the child, so the script stops exactly as on Ctrl-C (its ``KeyboardInterrupt``, then
  memdoctor records where it was), and the ``interrupted`` event names the real cause (``--timeout``,
  a SIGTERM to memdoctor) instead of "Ctrl-C".
- child -> supervisor: ``{"write_failed": {...}}`` when the trace could not be written (a full disk).
- end of file on the child's end: the supervisor is gone (``kill -9`` of memdoctor). The kernel closes
  its end whatever killed it, so this is the portable way to notice; on Linux the child also asks for
  SIGINT when its parent dies (``PR_SET_PDEATHSIG``), which does not need the watcher thread to run.
  Either way the script is stopped as on Ctrl-C, and if it does not stop within ``ORPHAN_GRACE_S``
  the child exits: an orphan never trains on, and its partial trace stays salvageable.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

ENV_VAR = "MEMDOCTOR_CONTROL"
ORPHAN_GRACE_S = 10.0  # an orphaned child that has not stopped on SIGINT after this long exits
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the supervisor's end, the child's end); the child's is inheritable, to be passed in pass_fds."""
    ours, theirs = socket.socketpair()
    theirs.set_inheritable(True)
    return ours, theirs


def send(sock: socket.socket | None, message: dict[str, Any]) -> bool:
    """Send one message; False when the other side is gone (nothing to tell, nothing to fail on)."""
    if sock is None:
        return False
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


def receive_all(sock: socket.socket) -> list[dict[str, Any]]:
    """Every message waiting on ``sock`` (without waiting for more): the supervisor's read after the
    child has exited."""
    sock.setblocking(False)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return messages(data)


def messages(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects in ``data``, one a line (a line that is not one is skipped)."""
    out = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict):
                out.append(msg)
    return out


def set_parent_death_signal(signum: int) -> None:
    """Linux: have the kernel send ``signum`` to this process when its parent dies. Elsewhere (or
    without libc) nothing: the watched socket is the portable way."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


class ChildControl:
    """The child's end: a daemon thread that waits for a stop request or for the supervisor to go."""

    def __init__(self, fd: int, parent_pid: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.parent_pid = parent_pid
        self.reason: str | None = None  # why the supervisor asked the script to stop
        self.stopping = False  # set by the child once it handles the stop: no second SIGINT then
        self._thread = threading.Thread(target=self._watch, name="memdoctor-control", daemon=True)

    def start(self) -> None:
        set_parent_death_signal(signal.SIGINT)
        if os.getppid() != self.parent_pid:  # died before the request was in place
            self.reason = self._orphan_reason()
        self._thread.start()
        if self.reason is not None:
            self._interrupt()

    def stop_reason(self) -> str:
        """The ``interrupted`` event's message: the supervisor's reason, memdoctor's death, or Ctrl-C."""
        self.stopping = True
        if self.reason is not None:
            return self.reason
        if os.getppid() != self.parent_pid:
            return self._orphan_reason()
        return "interrupted (Ctrl-C)"

    def send(self, message: dict[str, Any]) -> bool:
        return send(self.sock, message)

    def _orphan_reason(self) -> str:
        return f"stopped: memdoctor (pid {self.parent_pid}) ended while the script ran"

    def _watch(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                self._orphaned()
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for msg in messages(b"\n".join(lines)):
                if "stop" in msg and self.reason is None:
                    self.reason = str(msg["stop"])
                    self._interrupt()

    def _orphaned(self) -> None:
        """The supervisor is gone: stop the script as on Ctrl-C; exit if it has not after the grace."""
        if self.reason is None:
            self.reason = self._orphan_reason()
        time.sleep(0.5)  # the parent-death signal may be on its way: one Ctrl-C, not two
        self._interrupt()
        time.sleep(ORPHAN_GRACE_S)
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)

    def _interrupt(self) -> None:
        if not self.stopping:
            with contextlib.suppress(OSError):
                os.kill(os.getpid(), signal.SIGINT)


def child_control() -> ChildControl | None:
    """The child's end named by ``MEMDOCTOR_CONTROL`` (removed from the environment, so the script and
    its own children never see it), started; None when the child runs without a supervisor."""
    value = os.environ.pop(ENV_VAR, "")
    fd, _, parent = value.partition(":")
    if not fd.isdigit() or not parent.isdigit():
        return None
    control = ChildControl(int(fd), int(parent))
    control.start()
    return control
