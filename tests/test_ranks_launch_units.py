"""The pieces of ``--nproc-per-node`` that start no process: the options, torchrun's arguments, the
rank's identity and header field, and which rank failed first."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from memdoctor import exitcodes
from memdoctor.cli import main
from memdoctor.launch import rank_outcome
from memdoctor.launch.rank_outcome import RankEntry, outcome_lines
from memdoctor.launch.rank_trace import BackendWatchingWriter, identity, rank_header
from memdoctor.launch.ranklink import RankLine
from memdoctor.launch.ranks import Launched, RankJob
from memdoctor.trace import Trace, load_trace, make_header
from memdoctor.trace.records import distributed_of

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_ranks.py"

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("value", ["0", "two", "1.5", "-1", ""])
def test_bad_nproc_per_node_is_one_line_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--nproc-per-node", value, str(SCRIPT)])
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE_ERROR
    assert err.count("\n") == 1 and "--nproc-per-node takes a whole number of at least 1" in err


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--nnodes", "2"], "--nnodes is for a multi-process job"),
        (["--nproc-per-node", "2", "--master-port", "99999"], "--master-port takes a port number"),
        (["--nproc-per-node", "2", "--nnodes", "3:2"], "--nnodes takes N or MIN:MAX"),
        (["--nproc-per-node", "2", "--verify"], "--verify does not run with --nproc-per-node"),
    ],
)
def test_launch_options_refused_in_one_line(
    options: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["profile", *options, str(SCRIPT)])
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE_ERROR and err.count("\n") == 1 and words in err


def test_run_refuses_a_bad_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "memdoctor.yaml"
    config.write_text("memdoctor_config: 1\n")
    code = main(["run", "--config", str(config), "--nproc-per-node", "0", str(SCRIPT)])
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE_ERROR and "--nproc-per-node takes a whole number" in err


def test_torchrun_arguments() -> None:
    assert RankJob(2).torchrun_args() == [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "1",
        "--max-restarts",
        "0",
        "--standalone",
    ]
    job = RankJob(4, nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29400)
    assert job.torchrun_args()[-6:] == [
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29400",
    ]
    assert job.world_size == 8 and job.local_ranks() == [4, 5, 6, 7]


def test_identity_from_torchruns_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    rank = identity(env)
    assert rank == {"rank": 3, "world_size": 4, "local_rank": 1, "backend": None, "master": "h:29500"}
    assert identity({"WORLD_SIZE": "4"}) is None


def test_backend_from_the_event_into_the_header(tmp_path: Path) -> None:
    """The child's writer notes the process group once it exists; the header gets its backend."""
    import torch.distributed as dist

    path = tmp_path / "trace.jsonl.gz"
    rank = identity({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert rank is not None
    writer = BackendWatchingWriter(path)
    writer.write(make_header(distributed=rank))
    writer.write({"type": "event", "kind": "note", "message": "before the group", "t_unix": 1.0})
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        writer.write({"type": "event", "kind": "note", "message": "after the group", "t_unix": 2.0})
    finally:
        dist.destroy_process_group()
    writer.close()
    trace = load_trace(path, salvage=True)
    assert [e["kind"] for e in trace.events] == ["note", "distributed", "note"]
    header = rank_header(trace, rank)
    assert header["backend"] == "gloo"
    assert distributed_of({"distributed": header}) == header
    assert distributed_of({"distributed": {"rank": 2, "world_size": 2}}) is None  # rank out of range
    assert distributed_of({}) is None


def _entry(rank: int, status: str, ended_s: float | None, code: int = exitcodes.OK) -> RankEntry:
    return RankEntry(rank, status, 1, None, f"rank {rank} {status}", None, ended_s, memdoctor_exit_code=code)


def _result(entries: list[RankEntry]) -> Any:
    return rank_outcome.summarise(RankJob(len(entries)), entries, Launched(started_unix=0.0, launcher_code=1))


def test_failed_first_is_the_first_to_end_abnormally() -> None:
    """Not the lowest rank, nor the ones torn down afterwards: the first to end, by time."""
    entries = [
        _entry(0, "killed", 9.0, exitcodes.TERMINATED),
        _entry(1, "ok", 5.0),
        _entry(2, "oom", 7.5, exitcodes.OUT_OF_MEMORY),
        _entry(3, "exception", 8.0, exitcodes.SCRIPT_FAILED),
    ]
    result = _result(entries)
    assert result.failed_first == 2 and result.exit_code == exitcodes.OUT_OF_MEMORY
    assert result.failed_first_why == "rank 2 oom: rank 2 oom"
    assert entries[0].message.endswith("(after rank 2 had failed)")
    assert outcome_lines(result)[-1] == "failed first: rank 2 oom: rank 2 oom"
    assert result.as_dict()["ranks"][1]["status"] == "ok"


def test_all_ok_exits_0_and_unknown_times_come_last() -> None:
    assert _result([_entry(0, "ok", 1.0), _entry(1, "ok", 1.1)]).failed_first is None
    result = _result([_entry(0, "killed", None, exitcodes.SCRIPT_FAILED), _entry(1, "timeout", 30.0, 124)])
    assert result.failed_first == 1 and result.exit_code == exitcodes.TIMEOUT


def test_a_rank_that_did_not_report_is_finished_from_its_partial_trace(tmp_path: Path) -> None:
    """Its supervisor was killed: the partial trace gets an end saying so, and the report is written."""
    from memdoctor.trace import PARTIAL_SUFFIX, TRACE_FILENAME, TraceWriter

    folder = tmp_path / "rank-1"
    folder.mkdir()
    writer = TraceWriter(folder / (TRACE_FILENAME + PARTIAL_SUFFIX))
    writer.write(make_header(command={}, settings={"warmup": 0, "steps": 1, "budget_bytes": None}))
    writer.close()
    launched = Launched(started_unix=100.0, launcher_code=1)
    launched.lines[1] = RankLine(sock=None, hello={"rank": 1, "local_rank": 1}, closed_unix=103.5)  # type: ignore[arg-type]
    entry = rank_outcome.profile_entry(tmp_path, 1, launched)
    assert (entry.status, entry.trace, entry.ended_s, entry.local_rank) == (
        "killed",
        "rank-1/trace.jsonl.gz",
        3.5,
        1,
    )
    assert load_trace(folder / TRACE_FILENAME).end["status"] == "killed"  # type: ignore[index]
    assert (folder / "summary.json").is_file()
    nothing = rank_outcome.profile_entry(tmp_path, 0, launched)
    assert nothing.trace is None and "left no trace" in nothing.message
    later = Launched(started_unix=time.time() + 60, launcher_code=1)  # rank-1/ is an older run's (--force)
    stale = rank_outcome.profile_entry(tmp_path, 1, later)
    assert stale.trace is None and "left no trace" in stale.message


def test_trace_of_a_one_process_run_has_no_distributed() -> None:
    assert distributed_of(Trace(header=make_header()).header) is None


def test_a_job_memdoctor_stopped_has_no_failed_rank() -> None:
    """Ctrl-C to memdoctor stops every rank: none of them failed, and the exit code is Ctrl-C's; a rank
    that had failed before the stop is still the first failure."""
    launched = Launched(started_unix=0.0, launcher_code=130, signals=[2], stopped_unix=10.0)
    stopped = [_entry(0, "interrupted", 10.4, exitcodes.INTERRUPTED), _entry(1, "interrupted", 10.3, 130)]
    result = rank_outcome.summarise(RankJob(2), stopped, launched)
    assert result.failed_first is None and result.exit_code == exitcodes.INTERRUPTED
    assert result.failed_first_why == "no rank failed: memdoctor received Ctrl-C and stopped them"
    before = [_entry(0, "interrupted", 10.4, 130), _entry(1, "exception", 9.0, exitcodes.SCRIPT_FAILED)]
    assert rank_outcome.summarise(RankJob(2), before, launched).failed_first == 1
