"""The autocast what-if against a measured run: a tiny ResNet-shaped CNN (conv, BatchNorm, ReLU,
max-pool, residual adds, the loss in the loop) profiled in process in fp32 and under CPU bf16 autocast;
the activations the planner predicts for adding bf16 autocast, from the fp32 profile alone, are within
10% of those measured under it (before the type-based rule: +33%, BatchNorm's bytes kept in fp32).
Two in-process profiles, a few seconds on two cores: not in the fast subset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from amp_whatif_check import check


def test_a_tiny_cnns_predicted_autocast_activations_match_the_measured(tmp_path: Path) -> None:
    row = check("resnet-like CNN", tmp_path)
    assert row["bf16_measured"] < 0.7 * row["fp32"]  # autocast did store most of it in 16 bits
    assert row["bf16_predicted"] == pytest.approx(row["bf16_measured"], rel=0.10)
