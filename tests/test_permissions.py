"""Output files get the user's normal permissions (``0o666`` less the umask), not ``mkstemp``'s 0o600:
the report folder of a CI job or a shared disk must be able to serve report.html, summary.json,
memdoctor.yaml and the trace (issue 16)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from memdoctor.outputs import atomic_write, file_mode
from memdoctor.report import write_report
from memdoctor.trace import load_trace, save_trace

DATA = Path(__file__).parent / "data"
# A recorded GPU run with a budget: its report folder gets all three report files.
PLANNED = DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz"
CASES = [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)]


@pytest.fixture
def umask() -> Iterator[None]:
    """Restore the process's umask after a test that sets its own."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"), CASES)
def test_file_mode_follows_the_umask(umask: None, mask: int, expected: int) -> None:
    os.umask(mask)
    assert file_mode() == expected
    assert os.umask(mask) == mask  # reading it left the umask as it was


@pytest.mark.parametrize(("mask", "expected"), CASES)
def test_atomic_write_and_save_trace(umask: None, tmp_path: Path, mask: int, expected: int) -> None:
    os.umask(mask)
    atomic_write(tmp_path / "a.txt", "text")
    atomic_write(tmp_path / "b.bin", b"\x00\x01")
    saved = save_trace(load_trace(PLANNED), tmp_path / "trace.jsonl.gz")
    assert {p.name: _mode(p) for p in (tmp_path / "a.txt", tmp_path / "b.bin", saved)} == dict.fromkeys(
        ("a.txt", "b.bin", "trace.jsonl.gz"), expected
    )
    assert (tmp_path / "a.txt").read_text() == "text"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_report_files(umask: None, tmp_path: Path) -> None:
    """The report's three files (0o077 is covered by ``atomic_write`` above, which they go through)."""
    os.umask(0o022)
    paths = write_report(load_trace(PLANNED), tmp_path)
    assert set(paths) == {"summary", "report", "config"}
    assert {key: _mode(p) for key, p in paths.items()} == dict.fromkeys(paths, 0o644)
