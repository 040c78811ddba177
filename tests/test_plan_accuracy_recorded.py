"""The what-if model against GPU measurements: the profiles and the measured
peaks of ``benchmarks/plan_accuracy.py`` on an H200 are committed under ``tests/data/accuracy``; every
prediction the model makes today for those (workload, config) pairs is compared with the measured
``torch.cuda.max_memory_reserved()``. A change to the model that breaks its accuracy fails here."""

from __future__ import annotations

import json
import statistics
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from memdoctor.plan.config import Config, config_from_dict
from memdoctor.plan.model import predict, workload
from memdoctor.plan.workload import Workload
from memdoctor.report import build_summary
from memdoctor.trace import load_trace

DATA = Path(__file__).parent / "data" / "accuracy"
ROWS: list[dict[str, Any]] = json.loads((DATA / "h200-2026-12-02.json").read_text())["rows"]


@cache
def _workload(name: str) -> Workload:
    trace = load_trace(DATA / f"{name}-profile.jsonl.gz")
    w = workload(trace, build_summary(trace))
    assert w is not None
    return w


def _config(d: dict[str, Any]) -> Config:
    return config_from_dict(d)


def _error(row: dict[str, Any]) -> float:
    """(predicted - measured) / measured reserved peak: negative is an under-prediction (an OOM)."""
    p = predict(_workload(row["workload"]), _config(row["config"]))
    return (p.reserved_bytes - row["measured_max_reserved"]) / row["measured_max_reserved"]


def test_the_recorded_pairs_cover_four_models_and_the_levers() -> None:
    assert len(ROWS) >= 20 and {r["workload"] for r in ROWS} == {"bert", "gpt2", "vit", "llama"}
    configs = [_config(r["config"]) for r in ROWS]
    assert any(c.checkpoint for c in configs) and any(c.accumulation_steps > 1 for c in configs)
    assert any(c.precision == "bf16" for c in configs) and any(c.optimizer == "offload" for c in configs)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['workload']}-{r['label']}")
def test_each_prediction_is_close_and_never_far_under(row: dict[str, Any]) -> None:
    err = _error(row)
    assert err >= -0.05, f"under-predicted by {-err:.1%}: an OOM for the user"
    assert err <= 0.16, f"over-predicted by {err:.1%}"


def test_mean_absolute_error_of_the_changed_configs_is_within_five_percent() -> None:
    changed = [r for r in ROWS if r["label"] != "as profiled"]
    assert statistics.mean(abs(_error(r)) for r in changed) <= 0.05
