"""The planner's per-rank peak against the per-rank hook ledger on CPU gloo ranks (issue 17, point 6), and
the merged report of recorded multi-rank traces (point 7).

Recorded by ``python benchmarks/rank_accuracy.py --record tests/data`` (BENCHMARKS.md, "Several ranks on
the CPU"): for the two models of ``tests/scripts/rank_models.py`` (a stack of MLP blocks at a global
batch of 64, a small decoder at 16), the one-process trace (``cpu-<model>-b<B>.jsonl.gz``) and, for DDP,
FSDP2 and FSDP2 without resharding, the two ranks of the same script with that engine applied by
``memdoctor profile --nproc-per-node 2 --config`` (``cpu-<model>-b<B>-<engine>-2ranks/``: each rank's
trace and ``ranks.json``). The fast tests plan from the recorded traces and compare with the recorded
ranks; one slow test runs two ranks live.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memdoctor.cli import main
from memdoctor.plan.config import Config
from memdoctor.plan.model import predict, workload
from memdoctor.report.ranks import write_merged
from memdoctor.report.summary import build_summary
from memdoctor.trace import Trace, load_trace

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
SCRIPT = Path(__file__).parent / "scripts" / "rank_models.py"
MODELS = {"mlp": 64, "transformer": 16}  # each model's recorded global batch
ENGINES = ("ddp", "fsdp2", "fsdp2-no-reshard")
TARGET = 0.05  # issue 17: within 5%
SAMPLE = "transformer-b16-fsdp2-2ranks"  # sample_reports/<SAMPLE>, from tests/data/cpu-<SAMPLE>


def _one(model: str) -> Path:
    return DATA / f"cpu-{model}-b{MODELS[model]}.jsonl.gz"


def _ranks(model: str, engine: str) -> Path:
    return DATA / f"cpu-{model}-b{MODELS[model]}-{engine}-2ranks"


def _predicted(trace: Trace, engine: str, world: int = 2) -> int:
    """The planner's per-rank peak for ``engine`` on ``world`` ranks, no other lever."""
    w = workload(trace, build_summary(trace))
    assert w is not None
    blocks = () if engine == "ddp" else w.shard_names
    return predict(w, Config(gpus=world, parallel=engine, shard_modules=blocks)).peak_bytes


def _rank_summaries(folder: Path) -> list[dict[str, Any]]:
    return [build_summary(load_trace(folder / f"rank-{r}" / "trace.jsonl.gz")) for r in (0, 1)]


CASES = [pytest.param(m, e, id=f"{m}-{e}") for m in MODELS for e in ENGINES]


@pytest.mark.fast
@pytest.mark.parametrize(("model", "engine"), CASES)
def test_the_predicted_rank_peak_is_within_5_percent_of_each_ranks_ledger(model: str, engine: str) -> None:
    predicted = _predicted(load_trace(_one(model)), engine)
    for summary in _rank_summaries(_ranks(model, engine)):
        measured = summary["peak_memory_bytes"]
        assert abs(predicted - measured) <= TARGET * measured, (engine, predicted, measured)


@pytest.mark.fast
@pytest.mark.parametrize(("model", "engine"), CASES)
def test_a_rank_trace_plans_its_own_job_back_within_5_percent(model: str, engine: str) -> None:
    """``memdoctor plan RANK_TRACE --gpus 2``: the rank's one-process equivalent, spread again."""
    folder = _ranks(model, engine)
    predicted = _predicted(load_trace(folder / "rank-0" / "trace.jsonl.gz"), engine)
    measured = _rank_summaries(folder)[0]["peak_memory_bytes"]
    assert abs(predicted - measured) <= TARGET * measured, (engine, predicted, measured)


@pytest.mark.fast
@pytest.mark.parametrize("model", list(MODELS))
def test_each_ranks_ledger_holds_what_its_engine_holds(model: str) -> None:
    """Under the applied DDP the ledger counts its buckets (one more copy of the parameters); under
    FSDP2 half of the parameters and state, and its buffers; and each rank's saved activations are
    the same under every engine: the same computation on the same half of the batch (the loss's
    saved tensors too, which a stale count of FSDP2's buffers once kept out)."""
    one = build_summary(load_trace(_one(model)))
    params = one["categories"]["parameters"]
    acts = {}
    for engine in ENGINES:
        for rank, summary in enumerate(_rank_summaries(_ranks(model, engine))):
            cats = summary["categories"]
            if engine == "ddp":
                assert cats["gradient_buckets"] == cats["parameters"] == params
            else:
                assert math.ceil(params / 2) <= cats["parameters"] <= params // 2 + 1024  # padded shards
                assert cats["sharding_buffers"] > 0
            trace = load_trace(_ranks(model, engine) / f"rank-{rank}" / "trace.jsonl.gz")
            acts[engine, rank] = max(max(s.timeline["activations"]) for s in trace.profiled_steps())
    assert len(set(acts.values())) == 1, acts


@pytest.mark.fast
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_recorded_ranks_merge_into_one_report(tmp_path: Path, engine: str) -> None:
    folder = tmp_path / "job"
    shutil.copytree(_ranks("transformer", engine), folder)
    paths = write_merged(folder)
    merged = json.loads(paths["summary"].read_text())
    assert merged["world_size"] == 2
    # The recorded folder keeps the traces alone: each rank's figures are built from its trace.
    why = ("no readable summary.json: built from its trace", "no report.html")
    assert merged["problems"] == [f"rank {r}: {w}" for r in (0, 1) for w in why]
    peaks = [s["peak_memory_bytes"] for s in _rank_summaries(folder)]
    assert [r["peak_memory_bytes"] for r in merged["ranks"]] == peaks
    assert [r["status"] for r in merged["ranks"]] == ["ok", "ok"]
    assert merged["peak_memory_bytes"] == max(peaks)
    if engine == "fsdp2":  # the collectives FSDP2 calls through torch.distributed, measured
        assert merged["collectives"]["source"] == "measured"
    assert "<html" in paths["report"].read_text()


@pytest.mark.fast
def test_the_sample_multi_rank_report_is_rendered_from_the_recorded_ranks(tmp_path: Path) -> None:
    """``memdoctor report FOLDER --each-rank`` (what benchmarks/make_sample_reports.py runs): the
    merged report and each rank's, and the committed sample says what it says now."""
    out = tmp_path / "sample"
    assert main(["report", str(DATA / f"cpu-{SAMPLE}"), "--each-rank", "-o", str(out), "--force"]) == 0
    merged = json.loads((out / "summary.json").read_text())
    assert [r["report"] for r in merged["ranks"]] == ["rank-0/report.html", "rank-1/report.html"]
    assert all((out / f"rank-{r}" / "report.html").is_file() for r in (0, 1))
    committed = json.loads((REPO / "sample_reports" / SAMPLE / "summary.json").read_text())
    for key in ("world_size", "peak_memory_bytes", "headline", "ranks"):
        assert committed[key] == merged[key], key


@pytest.mark.slow
def test_two_live_fsdp2_ranks_peak_where_the_recorded_one_process_trace_predicts(tmp_path: Path) -> None:
    """The MLP stack profiled on two gloo ranks now, FSDP2 applied to the one-process script by
    ``--config``: each rank's ledger peak within 5% of the prediction from the recorded trace."""
    config = tmp_path / "memdoctor.yaml"
    blocks = ", ".join(f"blocks.{i}" for i in range(4))
    config.write_text(f"memdoctor_config: 1\ngpus: 2\nparallel: fsdp2\nshard_modules: [{blocks}]\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "memdoctor", "profile", "--nproc-per-node", "2", "--config", str(config)]
    command += ["--steps", "2", "--collect", "none", "-o", str(tmp_path / "out"), str(SCRIPT)]
    command += ["--", "--model", "mlp", "--batch-size", str(MODELS["mlp"])]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted = _predicted(load_trace(_one("mlp")), "fsdp2")
    for summary in _rank_summaries(tmp_path / "out"):
        measured = summary["peak_memory_bytes"]
        assert abs(predicted - measured) <= TARGET * measured, (predicted, measured)
