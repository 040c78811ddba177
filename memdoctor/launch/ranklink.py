"""The line between ``memdoctor profile|run --nproc-per-node N`` and each rank's supervisor.

A Unix socket at a path, in a private folder of the temporary directory, named to each rank in its
environment. Not the socketpair one child inherits (``memdoctor.launch.control``): the ranks are
``torch.distributed.run``'s workers, which it starts with ``close_fds`` and in sessions of their own,
so no descriptor of ours reaches them, while the environment does. Not per-rank files either: the
parent must learn at once that a rank has ended, and a rank that memdoctor is gone, whatever killed
either of them; the kernel closes a dead process's connection, which no file can say.

One JSON line per message:

- rank -> parent: ``{"hello": {"rank", "local_rank", "pid", "pgid"}}`` once connected (the process
  group the parent sweeps at the end, so that nothing outlives the run), then ``{"result": {...}}``
  (``memdoctor.launch.rank_worker``) just before the rank exits.
- parent -> rank: ``{"signal": "SIGINT" | "SIGTERM" | "SIGHUP"}``: stop as a one-process run stops on
  that signal. Ctrl-C goes to the rank's whole process group, as a terminal sends it to the foreground
  group (the script records where it was; its supervisor waits for it); SIGTERM and SIGHUP go to the
  rank's supervisor alone, which asks its script to stop and keeps what it measured.
- end of file at the rank: memdoctor is gone (``kill -9``); the rank stops as on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memdoctor.launch import control

SOCKET_NAME = "ranks.sock"
_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@dataclass
class RankLine:
    """What the parent knows of one connected rank."""

    sock: socket.socket
    hello: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    closed_unix: float | None = None  # when its connection closed: the rank's supervisor exited
    buffer: bytes = b""


class RankServer:
    """The parent's end: accepts the ranks and reads their messages when ``poll`` is called (no thread:
    the parent's wait loop polls it, and nothing is left running when the run is over)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="memdoctor-ranks-"))  # 0700: our user only
        self.path = self.folder / SOCKET_NAME
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self.lines: list[RankLine] = []

    def poll(self, timeout_s: float) -> None:
        for key, _ in self._selector.select(timeout_s):
            if key.fileobj is self._listener:
                self._accept()
            else:
                self._read(key.data)

    def by_rank(self) -> dict[int, RankLine]:
        """The ranks that said hello, by global rank."""
        return {line.hello["rank"]: line for line in self.lines if isinstance(line.hello.get("rank"), int)}

    def open_lines(self) -> list[RankLine]:
        return [line for line in self.lines if line.closed_unix is None]

    def broadcast(self, message: dict[str, Any]) -> None:
        for line in self.open_lines():
            control.send(line.sock, message)

    def close(self) -> None:
        for line in self.open_lines():
            with contextlib.suppress(OSError):
                self._selector.unregister(line.sock)
            line.sock.close()
        self._selector.close()
        self._listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            sock, _ = self._listener.accept()
            sock.setblocking(False)
            line = RankLine(sock)
            self.lines.append(line)
            self._selector.register(sock, selectors.EVENT_READ, line)

    def _read(self, line: RankLine) -> None:
        try:
            chunk = line.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            line.closed_unix = time.time()
            self._selector.unregister(line.sock)
            line.sock.close()
            return
        line.buffer += chunk
        *whole, line.buffer = line.buffer.split(b"\n")
        for msg in control.messages(b"\n".join(whole)):
            if isinstance(msg.get("hello"), dict):
                line.hello = msg["hello"]
            if isinstance(msg.get("result"), dict):
                line.result = msg["result"]


class RankClient:
    """A rank's end: says hello, acts on the parent's stop signals in a daemon thread, sends the result."""

    def __init__(self, path: str, hello: dict[str, Any]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.done = False  # the result is sent: an end of file after it is the rank's own exit
        control.send(self.sock, {"hello": {**hello, "pid": os.getpid(), "pgid": os.getpgid(0)}})
        threading.Thread(target=self._watch, name="memdoctor-ranklink", daemon=True).start()

    def send_result(self, result: dict[str, Any]) -> None:
        self.done = True
        control.send(self.sock, {"result": result})
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def _watch(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                if not self.done:  # memdoctor is gone: stop as on SIGTERM, keeping what was measured
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            buffer += chunk
            *whole, buffer = buffer.split(b"\n")
            for msg in control.messages(b"\n".join(whole)):
                if msg.get("signal") in _SIGNALS:
                    stop(getattr(signal, msg["signal"]))


def stop(signum: int) -> None:
    """Stop this rank as a one-process run stops on ``signum`` (see the module docstring)."""
    with contextlib.suppress(OSError):
        if signum == signal.SIGINT:
            os.killpg(os.getpgid(0), signum)
        else:
            os.kill(os.getpid(), signum)


def connect(path: str | None, hello: dict[str, Any]) -> RankClient | None:
    """The rank's line to memdoctor, or None when there is none to reach (the rank runs on alone, and
    ends by its own --timeout or by its launcher)."""
    if not path:
        return None
    try:
        return RankClient(path, hello)
    except OSError:
        return None
