"""The data collector and section: DataLoader wait per step, batch traits (shapes, real lengths, padding),
attribution to the step that trained on a batch (also when the loop fetches ahead), the fallback for
scripts without a DataLoader, clean removal of the patch, and the summary and report figures."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data.dataloader as dl
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tracebuilder import TraceBuilder, completed_trace, tiny_mlp, trace_from_records

from memdoctor.capture.batchtraits import BatchTraits, batch_traits, call_traits
from memdoctor.capture.dataloader import DataCollector
from memdoctor.capture.session import ProfileSession
from memdoctor.cli import main
from memdoctor.device import FakeDevice
from memdoctor.report import build_summary, render_report
from memdoctor.report.sections import data as data_section
from memdoctor.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parent.parent
ORIGINAL_NEXT = dl._BaseDataLoaderIter.__dict__["__next__"]
SEQ = 8


def padded(lengths: list[int], seq: int = SEQ, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` with the given real lengths, right-padded with ``pad``."""
    mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 50, (len(lengths), seq)) * mask + pad * (1 - mask)
    return ids, mask


# ----------------------------------------------------------------------------------------- traits


def test_padded_batch_with_a_known_padding_fraction() -> None:
    ids, mask = padded([3, 5, 8])
    field = batch_traits({"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(3)}).to_field(0)
    assert field["shapes"] == {"input_ids": [3, 8], "attention_mask": [3, 8], "labels": [3]}
    assert field["lengths"] == [3, 5, 8] and field["lengths_from"] == "attention_mask"
    assert (field["tokens"], field["real_tokens"]) == (24, 16)
    assert field["padding_fraction"] == pytest.approx(1 - 16 / 24, abs=1e-6)


def test_unnamed_tuples_find_the_mask_by_its_values() -> None:
    ids, mask = padded([3, 5, 8])
    token_types = torch.zeros_like(ids)  # 0/1 valued too, but no row starts or ends with a 1
    field = batch_traits((ids, token_types, mask, torch.zeros(3))).to_field(0)
    assert field["lengths_from"] == "2" and field["lengths"] == [3, 5, 8]
    left = batch_traits((ids.flip(1), mask.flip(1))).to_field(0)  # left padding
    assert left["lengths"] == [3, 5, 8]
    # No mask and no pad token: shapes only, nothing guessed.
    assert "tokens" not in batch_traits((ids, torch.zeros(3))).to_field(0)


def test_pad_token_gives_lengths_without_a_mask() -> None:
    ids, _ = padded([2, 7], pad=9)
    field = batch_traits({"input_ids": ids}, pad_token_id=9).to_field(0)
    assert field["lengths"] == [2, 7] and field["lengths_from"] == "input_ids != 9"
    unnamed = batch_traits([ids], pad_token_id=9).to_field(0)
    assert unnamed["real_tokens"] == 9


def test_nested_dataclass_and_call_inputs() -> None:
    from dataclasses import dataclass

    @dataclass
    class Batch:
        inputs: dict[str, torch.Tensor]
        target: torch.Tensor

    ids, mask = padded([4, 6])
    field = batch_traits(Batch({"input_ids": ids, "attention_mask": mask}, torch.zeros(2))).to_field(0)
    assert field["shapes"] == {"inputs.input_ids": [2, 8], "inputs.attention_mask": [2, 8], "target": [2]}
    assert field["real_tokens"] == 10
    call = call_traits((ids,), {"attention_mask": mask}, None).to_field(0)
    assert call["shapes"] == {"0": [2, 8], "attention_mask": [2, 8]} and call["lengths"] == [4, 6]


def test_work_per_batch_is_bounded() -> None:
    field = batch_traits([torch.zeros(1)] * 100).to_field(0)
    assert len(field["shapes"]) == 32 and field["shapes_truncated"] is True
    long_ids, long_mask = padded([1 + i % 8 for i in range(2000)])
    many = batch_traits({"input_ids": long_ids, "attention_mask": long_mask}).to_field(0)
    assert len(many["lengths"]) == 512 and many["lengths_sampled"] is True
    assert many["real_tokens"] == sum(1 + i % 8 for i in range(2000))  # from every row, not the sample


def test_lengths_left_on_the_device_are_read_in_to_field() -> None:
    traits = BatchTraits(shapes={"input_ids": [2, 4]}, elements=8, tokens=8, lengths=torch.tensor([1, 3]))
    assert traits.to_field(5)["lengths"] == [1, 3] and traits.to_field(5)["real_tokens"] == 4


# ----------------------------------------------------------------------------------------- capture


class Sleepy(Dataset[dict[str, torch.Tensor]]):
    """Token samples of known lengths; each item takes ``sleep`` seconds (or advances a fake clock)."""

    def __init__(self, lengths: list[int], sleep: float = 0.0, clock: FakeDevice | None = None) -> None:
        self.lengths, self.sleep, self.clock = lengths, sleep, clock

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        if self.clock is not None:
            self.clock.now_ms += 5.0
        ids, mask = padded([self.lengths[i]])
        return {"input_ids": ids[0], "attention_mask": mask[0], "labels": torch.tensor(i % 2)}


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return self.out(h.mean(1))


class Seen:
    """What the model's forward really got, per step (the truth the collector must match)."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.lengths: dict[int, list[list[int]]] = {}

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        rows = batch["attention_mask"].sum(1).tolist()
        self.lengths.setdefault(self.session.current_step(), []).append(rows)


def run(
    batches: Any,
    *,
    steps: int = 3,
    warmup: int = 1,
    device: Any = None,
    collector: DataCollector | None = None,
) -> tuple[list[dict[str, Any]], dict[int, list[list[int]]], DataCollector]:
    """Train TokenNet on ``batches`` (an iterable of dicts) under a profiling session."""
    torch.manual_seed(0)
    records: list[dict[str, Any]] = []
    collector = collector or DataCollector(device=device)
    session = ProfileSession(
        steps=steps, warmup=warmup, sink=records.append, device=device, collectors=[collector]
    )
    seen = Seen(session)
    model = TokenNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with session:
        for batch in batches:
            seen(batch)
            model(batch["input_ids"], attention_mask=batch["attention_mask"]).sum().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    assert not model._forward_pre_hooks, "the fallback hook must be removed"
    return records, seen.lengths, collector


def step_fields(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r.get("collectors", {}).get("data") for r in records if r["type"] == "step"}


def facts(records: list[dict[str, Any]]) -> dict[str, Any]:
    return [r["data"] for r in records if r["type"] == "collector" and r["name"] == "data"][-1]


def write(tmp_path: Path, records: list[dict[str, Any]]) -> Trace:
    return trace_from_records(tmp_path / "trace.jsonl.gz", records)


LENGTHS = [3, 5, 8, 2, 6, 7, 4, 8, 1, 5, 3, 6]


def test_planted_sleep_is_measured_as_wait(tmp_path: Path) -> None:
    sleep = 0.02
    records, seen, _ = run(DataLoader(Sleepy(LENGTHS, sleep=sleep), batch_size=2))
    fields = step_fields(records)
    assert sorted(fields) == [0, 1, 2, 3]
    for step, field in fields.items():
        assert field["fetches"] == 1
        assert field["wait_ms"] >= 2 * sleep * 1000  # two samples a batch
        assert [b["lengths"] for b in field["batches"]] == seen[step]
    summary = build_summary(write(tmp_path, records))
    assert summary["dataloader_wait_fraction"] > 0.05
    real = sum(LENGTHS[2:8])
    assert summary["padding_fraction"] == pytest.approx(1 - real / (6 * SEQ), abs=1e-6)
    assert summary["data"]["source"] == "dataloader" and summary["data"]["lookahead"] == 0
    assert summary["data"]["lengths"]["max"] == 8 and summary["data"]["lengths"]["count"] == 6
    assert summary["data"]["traits"]["class"] == "padded variable-length"


def lookahead(loader: DataLoader[Any]) -> Iterator[Any]:
    """Fetch one batch ahead, as accelerate's DataLoaderShard does to know which batch is the last."""
    it = iter(loader)
    current = next(it)
    for following in it:
        yield current
        current = following
    yield current


def epochs(loader: DataLoader[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        yield from lookahead(loader)


def test_lookahead_batches_go_to_the_step_that_trains_on_them() -> None:
    loader = DataLoader(Sleepy(LENGTHS[:6]), batch_size=2)  # 3 batches an epoch: epoch ends in the run
    records, seen, _ = run(epochs(loader, 3), steps=6)
    assert facts(records)["lookahead"] == 1
    fields = step_fields(records)
    for step, field in fields.items():
        assert [b["lengths"] for b in field["batches"]] == seen[step], step
    assert fields[0]["fetches"] == 2  # its own batch and the next one
    assert any(f.get("epoch_ends") for f in fields.values())


def test_fetch_hidden_behind_device_work_is_not_starvation() -> None:
    # The fake device's clock stands still while the loader works: the device was busy with queued work.
    device = FakeDevice()
    records, _, _ = run(DataLoader(Sleepy(LENGTHS, sleep=0.005), batch_size=2), device=device)
    hidden = step_fields(records)
    assert all(f["wait_ms"] >= 10 and f["device_wait_ms"] == 0 for f in hidden.values())
    # Now the device clock runs while the loader works: the device sat idle for 5 ms a sample.
    device = FakeDevice()
    records, _, _ = run(DataLoader(Sleepy(LENGTHS, clock=device), batch_size=2), device=device)
    assert all(f["device_wait_ms"] == pytest.approx(10.0) for f in step_fields(records).values())


def test_without_a_dataloader_the_model_inputs_are_measured() -> None:
    batches = []
    for i in range(6):
        ids, mask = padded(LENGTHS[2 * i : 2 * i + 2])
        batches.append({"input_ids": ids, "attention_mask": mask})
    records, seen, collector = run(batches)
    fields = step_fields(records)
    # The model is discovered at the first optimizer step; from then on its forward's inputs are used.
    assert "batches" not in (fields[0] or {})
    for step in (1, 2, 3):
        assert fields[step]["source"] == "forward"
        assert [b["lengths"] for b in fields[step]["batches"]] == seen[step]
        assert fields[step]["fetches"] == 0 and fields[step]["wait_ms"] == 0
    assert not collector._hooks


def test_patch_is_removed_after_stop_and_after_the_script_raises() -> None:
    collector = DataCollector()
    session = ProfileSession(steps=2, warmup=0, collectors=[collector])
    model = TokenNet()
    with pytest.raises(RuntimeError, match="planted"), session:
        assert dl._BaseDataLoaderIter.__dict__["__next__"] is not ORIGINAL_NEXT
        for batch in DataLoader(Sleepy(LENGTHS), batch_size=2):
            model(batch["input_ids"]).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            raise RuntimeError("planted")
    assert dl._BaseDataLoaderIter.__dict__["__next__"] is ORIGINAL_NEXT
    assert not model._forward_pre_hooks
    collector.stop()  # twice is fine
    assert dl._BaseDataLoaderIter.__dict__["__next__"] is ORIGINAL_NEXT


def test_a_missing_private_method_leaves_wait_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dl, "_BaseDataLoaderIter")
    records, _, _ = run([dict(zip(("input_ids", "attention_mask"), padded([2, 3]), strict=True))] * 5)
    assert "_BaseDataLoaderIter" in facts(records)["why_not"] and facts(records)["wait_measured"] is False
    fields = step_fields(records)
    assert "wait_ms" not in fields[1] and fields[1]["source"] == "forward"


def test_fetches_on_another_thread_are_not_the_loops_wait() -> None:
    loader = DataLoader(Sleepy(LENGTHS, sleep=0.002), batch_size=2)
    prefetched: list[Any] = []
    worker = threading.Thread(target=lambda: prefetched.extend(loader), name="user-prefetch")

    def batches() -> Iterator[Any]:
        worker.start()
        worker.join()
        yield from prefetched

    records, _, _ = run(batches())
    fields = step_fields(records)
    assert fields[0]["fetches"] == 0 and fields[0]["background_fetches"] == 6


def test_end_to_end_profile_writes_padding_fraction(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = str(ROOT / "examples" / "hf_trainer.py")
    code = main(
        ["profile", "--steps", "3", "-o", str(out), "--collect", "data", script, "--", "--steps", "6"]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    trace = load_trace(out / "trace.jsonl.gz")
    assert trace.collected["data"]["lookahead"] == 1  # accelerate's DataLoaderShard fetches ahead
    batches = [b for s in trace.profiled_steps() for b in s.collectors["data"]["batches"]]
    real, tokens = sum(b["real_tokens"] for b in batches), sum(b["tokens"] for b in batches)
    assert 0 < summary["padding_fraction"] == pytest.approx(1 - real / tokens, abs=1e-6)
    assert 0 <= summary["dataloader_wait_fraction"] < 1
    assert summary["data"]["traits"]["class"] == "padded variable-length"


# ----------------------------------------------------------------------------------------- analysis


def with_data(fields: list[dict[str, Any] | None], kind: str = "cpu") -> Trace:
    builder = TraceBuilder(kind=kind)
    builder.add_model(tiny_mlp())
    builder.add_steps(warmup=1, profiled=len(fields) - 1)
    trace = builder.end("completed").build()
    for step, field in zip(trace.steps, fields, strict=True):
        if field is not None:
            step.collectors["data"] = field
    return trace


def token_batch(lengths: list[int], seq: int) -> dict[str, Any]:
    n = len(lengths)
    shapes = {"input_ids": [n, seq], "attention_mask": [n, seq]}
    real = sum(lengths)
    return {
        "shapes": shapes,
        "elements": 2 * n * seq,
        "tokens": n * seq,
        "real_tokens": real,
        "lengths": lengths,
    }


def test_traits_classes() -> None:
    fixed = [{"shapes": {"x": [4, 3]}, "elements": 12}]
    summary = build_summary(with_data([{"batches": fixed}] * 3))
    assert summary["data"]["traits"]["class"] == "fixed-shape" and summary["padding_fraction"] is None
    assert summary["dataloader_wait_fraction"] is None  # no DataLoader was seen
    padded_steps = [{"batches": [token_batch([3, 5, 8], 8)]}] * 3
    summary = build_summary(with_data(padded_steps))
    assert summary["data"]["traits"]["class"] == "padded variable-length"
    assert summary["data"]["traits"]["level"] == "high" and summary["padding_fraction"] == pytest.approx(
        1 / 3
    )
    dynamic = [{"batches": [token_batch([3, 5], n)]} for n in (5, 6, 8)]
    summary = build_summary(with_data(dynamic))
    assert summary["data"]["traits"]["class"] == "dynamic shapes"
    assert summary["data"]["largest_batch"]["tokens"] == 16 and summary["data"]["largest_batch"]["step"] == 2
    assert summary["data"]["lengths"] == {
        "count": 4, "min": 3, "max": 5, "p50": 4.0, "p90": 5.0, "p99": 5.0, "mean": 4.0
    }  # fmt: skip


def test_starving_rests_on_device_idle_time() -> None:
    waits = [{"wait_ms": 50.0, "fetches": 1, "device_wait_ms": dev} for dev in (0.0, 1.0, 0.5, 0.0)]
    trace = with_data(waits, kind="cuda")
    summary = build_summary(trace)
    durations = [s.duration_ms for s in trace.steps]
    assert summary["dataloader_wait_fraction"] == pytest.approx(150 / sum(durations[1:]), abs=1e-6)
    assert summary["data"]["wait"]["starving"] is False  # the wait hid behind GPU work
    idle = [dict(w, device_wait_ms=d) for w, d in zip(waits, durations, strict=True)]
    starving = build_summary(with_data(idle, kind="cuda"))
    assert starving["data"]["wait"]["starving"] is True
    html = render_report(with_data(idle, kind="cuda"))
    assert 'id="data-starving"' in html and "The GPU is starving" in html


def test_garbage_in_the_trace_is_skipped() -> None:
    junk = {"wait_ms": "x", "fetches": -1, "batches": [1, {"shapes": "no", "tokens": True, "lengths": ["a"]}]}
    summary = build_summary(with_data([junk, junk, {"batches": "nope"}]))
    assert summary["padding_fraction"] is None and summary["dataloader_wait_fraction"] is None
    assert summary["data"]["lengths"] is None
    render_report(with_data([junk, junk, junk]))


def test_recorded_gpu_traces_measure_the_padded_batches() -> None:
    # Recorded on the H200 with every collector: bert_story pads random-length sequences to 512, the
    # GPT-2 Trainer workload packs full 512-token blocks.
    bert = build_summary(load_trace(ROOT / "tests" / "data" / "gpu-bert-base-b32-s512-fp32.jsonl.gz"))
    assert bert["padding_fraction"] is not None and 0.1 < bert["padding_fraction"] < 0.9
    assert bert["data"]["traits"]["class"] == "padded variable-length"
    assert bert["data"]["lengths"]["max"] <= 512
    assert bert["data"]["lengths"]["count"] == 32 * bert["steps_profiled"]
    assert all(b["attention_mask"] == [32, 512] for row in bert["data"]["steps"] for b in row["shapes"])
    assert 0 <= bert["dataloader_wait_fraction"] < 0.1
    gpt2 = build_summary(load_trace(ROOT / "tests" / "data" / "gpu-gpt2-small-trainer-b8-s512.jsonl.gz"))
    assert gpt2["padding_fraction"] == 0.0


def test_traces_from_before_collectors_say_not_measured() -> None:
    paths = [ROOT / "tests" / "data" / "pre-collectors-bert-base-b8-s128-8gib.jsonl.gz"]
    for path in paths:
        trace = load_trace(path)
        summary = build_summary(trace)
        assert summary["data"] is None and summary["padding_fraction"] is None
        assert summary["dataloader_wait_fraction"] is None
        assert data_section.report_section(trace, summary) is None
        section = _section(render_report(trace, summary))
        assert "Not measured:" in section


def test_report_section_with_data_and_escaped_names() -> None:
    evil = "<script>alert(1)</script>"
    batch = dict(token_batch([3, 5, 8], 8), shapes={evil: [3, 8], "attention_mask": [3, 8]})
    fields = [{"wait_ms": 1.0, "fetches": 1, "batches": [batch]}] * 4
    trace = with_data(fields)
    section = _section(render_report(trace))
    assert evil not in section and "&lt;script&gt;" in section
    assert 'id="data-steps"' in section and "padded variable-length" in section
    assert section.count("data:image/svg+xml;base64,") == 2  # wait chart and length histogram
    assert completed_trace() is not None  # the builder's default trace renders the section too
    assert "Not measured" in _section(render_report(completed_trace()))


def _section(html: str) -> str:
    match = re.search(r'<h2 id="data">.*?(?=<h2 )', html, re.S)
    assert match, "the data section is missing"
    return match.group(0)


def test_raw_lists_are_skipped_quickly() -> None:
    ids, mask = padded([2, 3])
    field = batch_traits(
        {"text": [list(range(512))] * 64, "input_ids": ids, "attention_mask": mask}
    ).to_field(0)
    assert field["shapes"] == {"input_ids": [2, 8], "attention_mask": [2, 8]} and field["real_tokens"] == 5


class BrokenMarkers(FakeDevice):
    def marker(self) -> Any:
        raise RuntimeError("device lost")


def test_a_failing_measurement_never_reaches_the_loop() -> None:
    collector = DataCollector(device=BrokenMarkers())
    records, seen, _ = run(DataLoader(Sleepy(LENGTHS), batch_size=2), collector=collector)
    assert sorted(seen)[:4] == [0, 1, 2, 3]  # the script ran every step
    assert "device lost" in facts(records)["failure"]
    assert dl._BaseDataLoaderIter.__dict__["__next__"] is ORIGINAL_NEXT


def test_a_run_that_dies_in_its_first_step_keeps_the_batch_it_fetched(tmp_path: Path) -> None:
    """An OOM at step 0 comes before any optimizer step (when the look-ahead is learned): the batch the
    step fetched still lands in the trace, so the data-traits axis and padding are measured."""
    import memdoctor

    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            self.emb(input_ids)
            raise torch.OutOfMemoryError("planted out of memory")

    ids, mask = padded([3, 5, 8, 2])
    loader = DataLoader([{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask, strict=True)], 4)
    model = Boom()
    torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(torch.OutOfMemoryError), memdoctor.profile(tmp_path / "out", steps=2, collect="data"):
        for batch in loader:
            model(**batch)
    trace = load_trace(tmp_path / "out" / "trace.jsonl.gz")
    [step] = trace.steps
    batches = step.collectors["data"]["batches"]
    assert batches[0]["lengths"] == [3, 5, 8, 2]
    assert build_summary(trace)["padding_fraction"] == pytest.approx(1 - 18 / 32, abs=1e-6)
