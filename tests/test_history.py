"""The allocator-history ledger: replaying a recorded step to its peak and attributing every block."""

from __future__ import annotations

from memdoctor.capture.history import _TORCH_DIR, _site, ledger_at_peak


def _alloc(addr: int, size: int, frames: list[dict] | None = None) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames or []}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size}


LOSS = [
    {"filename": _TORCH_DIR + "nn/functional.py", "line": 3, "name": "cross_entropy"},
    {"filename": "/u/train.py", "line": 42, "name": "main"},
]


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
        known={"activations": {100: 1000}, "gradients": {400: 800}, "optimizer_state": {}, "parameters": {}},
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
    assert led["temporaries_by_site"][0][0] == "functional.py:3 (cross_entropy) <- train.py:42 (main)"


def test_baseline_blocks_freed_before_the_peak_are_not_counted():
    # The record starts after the last step's optimizer step: its gradients (addr 900) are live, then
    # zero_grad frees them, then the step allocates past the start.
    entries = [_free(900, 800), _alloc(100, 1000), _alloc(300, 4000, LOSS)]
    led = ledger_at_peak(
        entries,
        baseline=7000 + 800,
        baseline_known={"parameters": 5000, "optimizer_state": 1500},
        known={"activations": {100: 1000}, "parameters": {}},
    )
    assert led is not None
    cats = led["categories"]
    assert led["peak_allocated"] == 7000 + 1000 + 4000
    assert cats["unattributed"] == 500
    assert sum(cats.values()) == led["peak_allocated"]


def test_reused_address_of_a_freed_activation_is_a_temporary():
    entries = [_alloc(100, 1024), _free(100, 1024), _alloc(100, 4096, LOSS)]
    led = ledger_at_peak(entries, baseline=0, baseline_known={}, known={"activations": {100: 1000}})
    assert led is not None
    assert led["categories"]["activations"] == 0
    assert led["categories"]["temporaries"] == 4096


def test_parameters_moved_during_the_record_are_not_counted_twice():
    entries = [_alloc(10, 2048), _alloc(20, 512)]
    led = ledger_at_peak(
        entries, baseline=0, baseline_known={"parameters": 2048}, known={"parameters": {10: 2048}}
    )
    assert led is not None
    assert led["categories"]["parameters"] == 2048
    assert led["categories"]["temporaries"] == 512


def test_no_entries_or_no_allocation_gives_none():
    assert ledger_at_peak([], baseline=0, baseline_known={}, known={}) is None
    assert ledger_at_peak([_free(1, 10)], baseline=0, baseline_known={}, known={}) is None


def test_site_without_frames_is_autograd():
    assert _site([]) == "autograd backward (no Python frame)"


def test_summary_and_report_carry_the_peak_ledger(tmp_path):
    from memdoctor.report import build_summary, render_report
    from tests.tracebuilder import completed_trace

    trace = completed_trace("cuda", None, 2)
    led = {
        "source": "allocator_history",
        "peak_allocated": 300,
        "baseline": 100,
        "categories": {"parameters": 100, "activations": 150, "temporaries": 50, "unattributed": 0},
        "temporaries_by_site": [["<script>x</script>:1 (f)", 50]],
        "peak_site": "x",
        "entries": 10,
    }
    trace.steps[-1].memory["peak_ledger"] = led
    summary = build_summary(trace)
    assert summary["peak_ledger"]["categories"]["temporaries"] == 50
    assert summary["peak_ledger"]["step"] == trace.steps[-1].step
    html = render_report(trace, summary)
    assert "<script>x</script>" not in html


def test_site_skips_memdoctors_own_frames_and_dispatch_plumbing():
    # Under the flops collector's dispatch mode the allocating op is called from memdoctor's frame
    # through torch's OpOverload.__call__: the site must still name the script's code.
    frames = [
        {"filename": _TORCH_DIR + "_ops.py", "line": 865, "name": "__call__"},
        {"filename": "/s/memdoctor/capture/flops.py", "line": 247, "name": "__torch_dispatch__"},
        {
            "filename": "/x/transformers/models/bert/modeling_bert.py",
            "line": 125,
            "name": "eager_attention_forward",
        },
        {"filename": "/home/me/train.py", "line": 40, "name": "main"},
    ]
    assert _site(frames) == "modeling_bert.py:125 (eager_attention_forward)"


def test_site_outside_torch_is_judged_by_torchs_directory_not_a_substring():
    """On the H200 the virtual environment lives in /opt/torch/.venv: transformers' path holds "/torch/"
    and must still count as outside PyTorch."""
    frames = [
        {"filename": _TORCH_DIR + "nn/functional.py", "line": 3, "name": "cross_entropy"},
        {"filename": "/opt/torch/.venv/lib/site-packages/transformers/loss.py", "line": 7, "name": "loss"},
        {"filename": "/home/me/train.py", "line": 42, "name": "main"},
    ]
    assert _site(frames) == "functional.py:3 (cross_entropy) <- loss.py:7 (loss)"
