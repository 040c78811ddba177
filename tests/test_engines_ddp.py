"""DDP on two gloo ranks: each rank's hook ledger equals what its tensors hold, its gradient buckets
counted once (``gradient_buckets``), the link measured, and the ranks never wait on one another past
the link's bound (``tests/engines_worker.py`` runs the ranks)."""

from __future__ import annotations

import time

import pytest
from engines_worker import STEPS, UNEVEN_WAIT_S, launch, load


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_ledger_equals_the_tensors(tmp_path, bucket_view):
    launch(tmp_path, "ddp", bucket_view)
    for rank in (0, 1):
        trace, truth = load(tmp_path, rank)
        assert len(trace.steps) == 1 + STEPS
        for step in trace.steps:
            held = truth["steps"][step.step]
            tl = step.timeline
            i = tl["event"].index("opt_post")
            assert tl["parameters"][i] == held["parameters"]
            assert tl["optimizer_state"][i] == held["optimizer_state"]
            # The buckets once: with bucket views the gradients are in them, and nothing is left over.
            assert tl["gradients"][i] + tl["gradient_buckets"][i] == held["gradients_and_buckets"]
            if bucket_view:
                assert tl["gradient_buckets"][i] == 0
                assert tl["gradients"][i] == held["bucket_storages"]
            else:
                assert tl["gradient_buckets"][i] == held["bucket_storages"] > 0
                assert tl["gradients"][i] == held["gradient_storages"]
            assert "gradient_buckets" in step.memory["categories_at_peak"]
            # DDP's own all-reduces are C++: the step says they are not in its collectives.
            assert step.collectives is not None
            assert step.collectives["not_measured"]
        (ddp,) = trace.collected["engines"]["ddp"]
        assert ddp["gradient_as_bucket_view"] is bucket_view
        assert ddp["bucket_bytes"] == truth["steps"][-1]["bucket_storages"]
        # DDP's own logger timed its bucket all-reduces (an iteration's figures come with the next).
        assert len(ddp["reducer_timings"]) >= STEPS - 1
        assert all(t["comm_ms"] > 0 and t["compute_ms"] > 0 for t in ddp["reducer_timings"])
        link = trace.collected["link"]
        assert link["measured"] is True and link["world_size"] == 2 and link["backend"] == "gloo"
        assert link["bytes_per_s"] > 0


def test_ranks_at_different_steps_skip_the_link_instead_of_waiting(tmp_path):
    """Rank 1 reaches its last profiled step one step before rank 0: each waits for the other at most
    the bound, decides to skip, and both traces say why; the training goes on and ends."""
    t0 = time.monotonic()
    launch(tmp_path, "ddp", False, uneven=True)
    assert time.monotonic() - t0 < 8 * UNEVEN_WAIT_S + 20
    for rank in (0, 1):
        trace, _ = load(tmp_path, rank)
        link = trace.collected["link"]
        assert link["measured"] is False
        assert "within" in link["reason"]
