"""``parallel`` applied to an unmodified one-process script on two ranks (gloo on the CPU), launched as
``memdoctor run --nproc-per-node 2`` runs it: ``torch.distributed.run`` starting ``memdoctor.launch.
run_child`` in each rank, the plan in ``MEMDOCTOR_RUN``.

Faithful: the one-process run and the two ranks are given the same script batch of 2B; each rank reads
batches of B (the DistributedSampler's shares, in order, at 1/N of the script's batch), so both train on
the same global batches, so the ranks' mean loss at
each of the 5 steps, and the loss on all the samples after the last, equal the one-process run's within
LOSS_RTOL: fp32, and only the order of the sums differs (gloo averages the ranks' gradients, one process
averages over its whole batch). The script's optimizer-step count is its own: 5 on each rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memdoctor.config import parse_config
from memdoctor.launch.run_child import ENV_VAR
from tests.test_run import REPO, run_script

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "run_parallel.py"
B, STEPS = 2, 5
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7


def _on_two_ranks(config: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The script on two ranks with ``config`` applied in each (``memdoctor run``'s child, unchanged)."""
    cfg = parse_config("memdoctor_config: 1\ngpus: 2\n" + config)
    script_args = ["--batch-size", str(2 * B), "--out", str(out), *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env[ENV_VAR] = json.dumps(
        {"config": cfg.as_dict(), "script": str(SCRIPT), "module": None, "args": script_args}
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "memdoctor.launch.run_child"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def _read(out: Path, rank: int) -> dict[str, Any]:
    return json.loads(Path(f"{out}.rank{rank}.json").read_text())


def _one_process(tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "one"
    run_script(SCRIPT, ["--batch-size", str(2 * B), "--out", str(out)])
    return _read(out, 0)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b)


@pytest.mark.parametrize(
    ("config", "line"),
    [
        (
            "parallel: fsdp2\nshard_modules: [blocks.0, blocks.1]\n",
            "parallel: fsdp2: Net sharded over 2 ranks with FSDP2 fully_shard (2 modules and the root, "
            "reshard_after_forward=True",
        ),
        ("parallel: ddp\n", "parallel: ddp: Net wrapped in DistributedDataParallel over 2 ranks"),
        (
            "parallel: fsdp2-no-reshard\nfull_offload: true\n",
            "(0 modules and the root, reshard_after_forward=False; parameters, gradients and optimizer "
            "state on the host",
        ),
    ],
    ids=["fsdp2", "ddp", "fsdp2-no-reshard-offload"],
)
def test_two_ranks_train_as_one_process_on_the_global_batch(tmp_path: Path, config: str, line: str) -> None:
    one = _one_process(tmp_path)
    out = tmp_path / "ranks"
    proc = _on_two_ranks(config, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [_read(out, r) for r in (0, 1)]
    assert one["steps"] == STEPS and [r["steps"] for r in ranks] == [STEPS, STEPS]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert all(_close(m, o) for m, o in zip(mean, one["losses"], strict=True)), (mean, one["losses"])
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank read its own share
    for r in ranks:
        assert _close(r["final"], one["final"]), (r["final"], one["final"])
    assert proc.stderr.count(line) == 2, proc.stderr[-3000:]
    assert "DistributedSampler on 1 DataLoader(s): rank 1 read 1/2 of the samples" in proc.stderr


def test_a_script_starting_its_own_group_is_refused_by_name(tmp_path: Path) -> None:
    proc = _on_two_ranks("parallel: ddp\n", tmp_path / "own", "--own-group")
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("memdoctor: error:")]
    assert said and all(
        x.startswith(
            "memdoctor: error: parallel: the script starts its own process group "
            "(torch.distributed.init_process_group)"
        )
        for x in said
    ), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # the ConfigError's code, each rank before its first step
    assert not list(tmp_path.glob("own.rank*.json"))
