"""``memdoctor.launch.leave``: a rank whose group memdoctor started ends with ``os._exit`` after the
exit steps a script relies on (its non-daemon threads, its ``atexit`` handlers, its open files' buffers),
so gloo's threads cannot abort it during the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from memdoctor.launch.leave import flush_open_files
from memdoctor.levers.owngroup import start_own_group, started_a_group
from tests.test_run import REPO


def test_open_files_buffers_reach_the_disk_text_layer_first(tmp_path: Path) -> None:
    text, raw = tmp_path / "t.txt", tmp_path / "b.bin"
    ft = open(text, "w", buffering=1 << 20)  # noqa: SIM115 - left open, as a script might
    fb = open(raw, "wb", buffering=1 << 20)  # noqa: SIM115
    try:
        ft.write("line\n" * 10)
        fb.write(b"\x01" * 100)
        assert text.read_text() == "" and raw.read_bytes() == b""  # still in the buffers
        flush_open_files()
        assert text.read_text() == "line\n" * 10
        assert raw.read_bytes() == b"\x01" * 100
    finally:
        ft.close()
        fb.close()


def test_a_group_memdoctor_started_is_known_after_it_is_destroyed() -> None:
    """The children ask ``started_a_group`` after the script: the group may be destroyed by then, and
    gloo's threads still alive (full_offload's world of one here, as ``memdoctor run`` starts it)."""
    undo = start_own_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        undo()
    assert not dist.is_initialized()
    assert started_a_group()


@pytest.mark.slow
def test_leave_runs_threads_atexit_and_files_then_exits_with_the_code(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = textwrap.dedent(
        f"""
        import atexit, threading, time
        from memdoctor.launch.leave import leave
        log = open({str(out)!r}, "w", buffering=1 << 20)
        def late():
            time.sleep(0.3)
            log.write("thread\\n")
        threading.Thread(target=late).start()
        atexit.register(lambda: log.write("atexit\\n"))
        log.write("script\\n")
        leave(7)
        log.write("after\\n")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 7, proc.stderr
    assert out.read_text() == "script\nthread\natexit\n"  # Python's order; nothing after leave
