"""The allocator-history ledger: replaying a recorded step to its peak and attributing every block."""

from __future__ import annotations

from memdoctor.capture.history import _site, ledger_at_peak


def _alloc(addr: int, size: int, frames: list[dict] | None = None) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames or []}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size}


LOSS = [{"filename": "/x/torch/nn/functional.py", "line": 3, "name": "cross_entropy"},
        {"filename": "/u/train.py", "line": 42, "name": "main"}]


def test_peak_blocks_are_attributed_by_address_and_site():
    entries = [
        _alloc(100, 1000),  # a saved activation
        _alloc(200, 500, LOSS),  # a temporary of the loss
        _free(200, 500),
        _alloc(300, 4000, LOSS),  # the peak's temporary
        _alloc(400, 800),  # a gradient
        _free(300, 4000),
        _alloc(500, 10),
    ]
    led = ledger_at_peak(
        entries,
        baseline=7000,
        baseline_known={"parameters": 5000, "optimizer_state": 1500},
        known={"activations": {100}, "gradients": {400}, "optimizer_state": set(), "parameters": set()},
    )
    assert led is not None
    cats = led["categories"]
    assert led["peak_allocated"] == 7000 + 1000 + 4000 + 800
    assert cats["activations"] == 1000
    assert cats["gradients"] == 800
    assert cats["temporaries"] == 4000
    assert cats["parameters"] == 5000 and cats["optimizer_state"] == 1500
    assert cats["unattributed"] == 500
    assert sum(cats.values()) == led["peak_allocated"]
    assert led["temporaries_by_site"][0][1] == 4000
    assert "functional.py:3 (cross_entropy) <- train.py:42 (main)" == led["temporaries_by_site"][0][0]


def test_no_entries_or_no_allocation_gives_none():
    assert ledger_at_peak([], baseline=0, baseline_known={}, known={}) is None
    assert ledger_at_peak([_free(1, 10)], baseline=0, baseline_known={}, known={}) is None


def test_site_without_frames_is_autograd():
    assert _site([]) == "autograd backward (no Python frame)"
