"""``memdoctor profile|run --nproc-per-node 2``: a torchrun script (gloo, CPU) run through
``torch.distributed.run``, every rank profiled as one process is; one rank failing or hanging.

Each test starts a real job of two ranks, so none is fast: torch's start-up in each process, DDP's own
(about 4 s), and a report rendered per rank set their time. Every test also checks that no process of
the job outlives the command: each run is marked with an environment variable that torchrun hands on
to every worker and that the script's process inherits, and no live process may still carry it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.trace import load_trace

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ddp_ranks.py"
MARK = "MEMDOCTOR_TEST_JOB"


def memdoctor(*args: str, cwd: Path, mark: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env[MARK] = mark
    return subprocess.run(
        [sys.executable, "-m", "memdoctor", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def marked_processes(mark: str) -> list[str]:
    """Live processes whose environment carries ``MARK=mark`` (zombies have none: they are gone)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name}: {command}")
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def profile_job(
    tmp_path: Path, *options: str, script_args: tuple[str, ...]
) -> tuple[Any, dict[str, Any], Path]:
    mark = uuid.uuid4().hex
    out = tmp_path / "out"
    proc = memdoctor(
        "profile",
        "--nproc-per-node",
        "2",
        "-o",
        str(out),
        *options,
        str(SCRIPT),
        "--",
        *script_args,
        cwd=tmp_path,
        mark=mark,
    )
    assert marked_processes(mark) == [], "a process of the job outlived memdoctor"
    ranks_json = out / "ranks.json"
    assert ranks_json.is_file(), proc.stderr[-3000:]
    return proc, json.loads(ranks_json.read_text()), out


def test_ddp_script_profiled_on_two_ranks(tmp_path: Path) -> None:
    """A DDP script that makes its process group from torchrun's environment, unedited: two complete
    rank folders, each trace's header saying its rank, the world size and the backend."""
    proc, ranks, out = profile_job(tmp_path, "--steps", "2", script_args=("--steps", "20"))
    assert proc.returncode == exitcodes.OK, proc.stderr[-3000:]
    assert ranks["world_size"] == 2
    assert [(r["rank"], r["status"], r["trace"]) for r in ranks["ranks"]] == [
        (0, "ok", "rank-0/trace.jsonl.gz"),
        (1, "ok", "rank-1/trace.jsonl.gz"),
    ]
    assert ranks["failed_first"] is None
    for k in (0, 1):
        folder = out / f"rank-{k}"
        assert (folder / "summary.json").is_file() and (folder / "report.html").is_file()
        trace = load_trace(folder / "trace.jsonl.gz")
        dist = trace.header["distributed"]
        assert (dist["rank"], dist["world_size"], dist["local_rank"], dist["backend"]) == (k, 2, k, "gloo")
        assert dist["master"] and ":" in dist["master"]
        assert trace.end is not None and trace.end["status"] == "completed"
        assert sum(1 for s in trace.steps if s.complete and not s.warmup) == 2
    assert "rank 0: ok" in proc.stderr and "rank 1: ok" in proc.stderr


def test_one_rank_raising_is_the_first_failure(tmp_path: Path) -> None:
    """Rank 1 raises at step 2 while rank 0 waits in the all-reduce: rank 1 failed first, with its
    exception; rank 0's trace is readable too; the exit code is rank 1's; nothing is left running."""
    args = ("--sync", "allreduce", "--fail-rank", "1", "--fail-step", "2")
    proc, ranks, out = profile_job(tmp_path, "--steps", "5", script_args=args)
    assert proc.returncode == exitcodes.SCRIPT_FAILED, proc.stderr[-3000:]
    by_rank = {r["rank"]: r for r in ranks["ranks"]}
    assert by_rank[1]["status"] == "exception"
    assert "failed on purpose at step 2" in by_rank[1]["message"]
    assert by_rank[0]["status"] != "ok"
    assert ranks["failed_first"] == 1
    assert ranks["failed_first_why"].startswith("rank 1 exception:")
    assert by_rank[1]["ended_s"] <= by_rank[0]["ended_s"]
    for k in (0, 1):
        trace = load_trace(out / by_rank[k]["trace"])
        assert trace.header["distributed"]["rank"] == k
        assert sum(1 for s in trace.steps if s.complete) == 2  # steps 0 and 1 on both ranks
    assert "failed first: rank 1" in proc.stderr


def test_one_rank_out_of_memory(tmp_path: Path) -> None:
    """An out-of-memory error on one rank: that rank is ``oom`` and failed first; exit code 6."""
    args = ("--sync", "allreduce", "--fail-rank", "0", "--fail-step", "1", "--fail", "oom")
    proc, ranks, out = profile_job(tmp_path, "--steps", "3", script_args=args)
    assert proc.returncode == exitcodes.OUT_OF_MEMORY, proc.stderr[-3000:]
    assert ranks["failed_first"] == 0 and ranks["ranks"][0]["status"] == "oom"
    assert load_trace(out / ranks["ranks"][1]["trace"]).header["distributed"]["rank"] == 1
    assert "the re-profile does not run per rank yet" in proc.stderr  # not left to think it ran


def test_timeout_with_a_hung_rank(tmp_path: Path) -> None:
    """Rank 1 hangs at its first step, rank 0 then waits in the all-reduce: --timeout stops both, both
    traces are readable, the hung rank is named first, and no process is left."""
    args = ("--sync", "allreduce", "--fail-rank", "1", "--fail-step", "0", "--fail", "hang")
    proc, ranks, out = profile_job(tmp_path, "--timeout", "15", script_args=args)
    assert proc.returncode == exitcodes.TIMEOUT, proc.stderr[-3000:]
    assert [r["status"] for r in ranks["ranks"]] == ["timeout", "timeout"]
    assert ranks["failed_first"] == 1
    for k in (0, 1):
        trace = load_trace(out / f"rank-{k}" / "trace.jsonl.gz")
        assert trace.end is not None and trace.end["status"] == "timeout"
    hung = load_trace(out / "rank-1" / "trace.jsonl.gz")
    stops = [e["message"] for e in hung.events if e["kind"] == "interrupted"]
    assert stops == ["stopped: --timeout expired"]


def test_run_exit_code_is_the_failed_ranks(tmp_path: Path) -> None:
    """``memdoctor run --nproc-per-node 2``: each rank runs the script to its end with the plan; one
    rank raising makes the command's exit code the script's (1), and nothing is left running."""
    config = tmp_path / "memdoctor.yaml"
    config.write_text("memdoctor_config: 1\n")
    mark = uuid.uuid4().hex
    args = ("--sync", "allreduce", "--steps", "4", "--fail-rank", "0", "--fail-step", "1")
    proc = memdoctor(
        "run",
        "--config",
        str(config),
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--",
        *args,
        cwd=tmp_path,
        mark=mark,
    )
    assert marked_processes(mark) == []
    assert proc.returncode == exitcodes.SCRIPT_RAISED, proc.stderr[-3000:]
    assert "failed first: rank 0 exception" in proc.stderr
