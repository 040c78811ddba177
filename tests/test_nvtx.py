"""NVTX ranges: a fake NVTX domain records every push/pop and start/end the collector makes, so the
ranges an Nsight Systems capture would show can be checked on a CPU."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

import nvtx  # memdoctor[gpu], also in memdoctor[dev]
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memdoctor.analysis import nvtx as nvtx_note
from memdoctor.capture import nvtxranges
from memdoctor.capture.collectors import CollectorUnavailable, make_collectors
from memdoctor.capture.session import ProfileSession
from memdoctor.device import FakeDevice
from memdoctor.report import build_summary
from memdoctor.report.render import render_report, report_context
from tests.tracebuilder import completed_trace


@dataclass
class Attrs:
    message: str
    category: str | None


@dataclass
class FakeDomain:
    """Records ``(op, name)``: ``push``/``pop`` (thread-local nesting), ``start``/``end`` (handles)."""

    log: list[tuple[str, str]] = field(default_factory=list)
    open_: dict[int, Attrs] = field(default_factory=dict)
    pushed: list[str] = field(default_factory=list)
    categories: dict[str, str | None] = field(default_factory=dict)
    next_id: int = 0

    def get_event_attributes(self, message: str, color: Any = None, category: Any = None) -> Attrs:
        return Attrs(message, category)

    def push_range(self, attrs: Attrs) -> None:
        self.pushed.append(attrs.message)
        self.log.append(("push", attrs.message))

    def pop_range(self) -> None:
        assert self.pushed, "pop_range without an open push range"
        self.log.append(("pop", self.pushed.pop()))

    def start_range(self, attrs: Attrs) -> int:
        self.next_id += 1
        self.open_[self.next_id] = attrs
        self.categories[attrs.message] = attrs.category
        self.log.append(("start", attrs.message))
        return self.next_id

    def end_range(self, handle: int) -> None:
        assert handle in self.open_, "end_range of a range that is not open"
        self.log.append(("end", self.open_.pop(handle).message))


@pytest.fixture
def domain(monkeypatch: pytest.MonkeyPatch) -> FakeDomain:
    fake = FakeDomain()
    monkeypatch.setattr(nvtx, "get_domain", lambda name=None: fake)
    return fake


class Block(nn.Module):
    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("planted")
        return x + self.act(self.attn(x))


class Net(nn.Module):
    def __init__(self, fail_at: int = -1, ckpt: bool | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block(), Block(fail_at)])
        self.head = nn.Linear(8, 2)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h) if self.ckpt is None else checkpoint(layer, h, use_reentrant=self.ckpt)
        return self.head(h)


QUALIFIED = {"Net", "embed", "layers.0", "layers.0.attn", "layers.0.act", "layers.1", "layers.1.attn"}
QUALIFIED |= {"layers.1.act", "head"}


def _run(model: nn.Module, session: ProfileSession, iters: int = 8, micro: int = 1) -> None:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with session:
        for _ in range(iters):
            for _ in range(micro):
                # the script survives a module that raised, and trains on
                with contextlib.suppress(ValueError):
                    model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break


def _by_step(log: list[tuple[str, str]]) -> dict[int, list[tuple[str, str]]]:
    """The events inside each ``step N`` range (its own start and end left out)."""
    out: dict[int, list[tuple[str, str]]] = {}
    step: int | None = None
    for op, name in log:
        if name.startswith("step "):
            step = int(name.split()[1]) if op == "start" else None
            continue
        if step is not None:
            out.setdefault(step, []).append((op, name))
    return out


def _assert_balanced(events: list[tuple[str, str]]) -> None:
    """Pushes and pops match and nest; every start has its end."""
    stack: list[str] = []
    started: dict[str, int] = {}
    for op, name in events:
        if op == "push":
            stack.append(name)
        elif op == "pop":
            assert stack and stack.pop() == name
        elif op == "start":
            started[name] = started.get(name, 0) + 1
        else:
            started[name] -= 1
    assert stack == []
    assert all(n == 0 for n in started.values()), started


def test_ranges_are_balanced_named_and_phased(domain: FakeDomain) -> None:
    records: list[dict[str, Any]] = []
    coll = nvtxranges.NvtxCollector()
    assert coll.attached and coll.wants_modules
    _run(Net(), ProfileSession(steps=2, warmup=1, sink=records.append, collectors=[coll]))
    assert domain.open_ == {} and domain.pushed == []  # everything ended by the end of the run
    steps = _by_step(domain.log)
    assert sorted(steps) == [0, 1, 2]
    for step, events in steps.items():
        _assert_balanced(events)
        phases = [name for op, name in events if op == "start" and domain.categories[name] == "phase"]
        assert phases == ["forward", "backward", "optimizer"], step
    # From step 1 on (after discovery at the first optimizer step) modules carry qualified names.
    later = steps[1] + steps[2]
    assert {name for op, name in later if op == "push"} == QUALIFIED
    backward = {name for op, name in later if op == "start" and domain.categories[name] == "backward"}
    assert backward == QUALIFIED  # every module here is timed (tiny model)
    # Step 0's forward ran before discovery: class names.
    assert {name for op, name in steps[0] if op == "push"} == {"Net", "Linear", "Block", "GELU"}
    # Module forward ranges nest inside the forward phase, their backward ranges inside backward.
    fwd = steps[2]
    assert fwd.index(("start", "forward")) < fwd.index(("push", "Net")) < fwd.index(("end", "forward"))
    assert fwd.index(("start", "backward")) < fwd.index(("start", "head")) < fwd.index(("end", "backward"))
    assert {"type": "collector", "name": "nvtx", "data": {**_record(records), "emitted": True}} in records


def _record(records: list[dict[str, Any]]) -> dict[str, Any]:
    data = next(r["data"] for r in records if r.get("name") == "nvtx")
    assert data["domain"] == "memdoctor" and data["version"]
    return dict(data)


def test_balanced_after_a_module_raises(domain: FakeDomain) -> None:
    # layers.1 raises on its 3rd call (step 2's forward): the exception unwinds through Net to the
    # script, which carries on; no post hook of layers.1 or Net runs for that call.
    coll = nvtxranges.NvtxCollector()
    _run(Net(fail_at=3), ProfileSession(steps=3, warmup=1, collectors=[coll]), iters=10)
    steps = _by_step(domain.log)
    assert ("push", "layers.1") in steps[2] and sorted(steps) == [0, 1, 2, 3]
    for events in steps.values():
        _assert_balanced(events)
    assert domain.pushed == [] and domain.open_ == {}


class Catching(nn.Module):
    """Calls a child that raises and swallows the error inside its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ok, self.bad = nn.Linear(4, 2), Block(fail_at=1)
        self.bad.attn = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(ValueError):
            self.bad(x)
        return self.ok(x)


def test_balanced_when_the_parent_catches(domain: FakeDomain) -> None:
    coll = nvtxranges.NvtxCollector()
    _run(Catching(), ProfileSession(steps=1, warmup=1, collectors=[coll]))
    events = _by_step(domain.log)[0]
    _assert_balanced(events)
    # "bad" raised: the session's post hook runs for a forward that raises too (always_call), so its
    # range ends there, before its sibling "ok" runs.
    assert [e for e in events if e[0] in ("push", "pop")] == [
        ("push", "Catching"),
        ("push", "Block"),
        ("pop", "Block"),
        ("push", "Linear"),
        ("pop", "Linear"),
        ("pop", "Catching"),
    ]


def test_timing_steps_get_only_step_and_optimizer_ranges(domain: FakeDomain) -> None:
    coll = nvtxranges.NvtxCollector()
    session = ProfileSession(steps=4, warmup=1, device=FakeDevice(), collectors=[coll])
    _run(Net(), session, iters=10)
    steps = _by_step(domain.log)
    assert [s for s in sorted(steps) if not session.detailed(s)] == [2, 3]
    for s in (2, 3):
        assert steps[s] == [("start", "optimizer"), ("end", "optimizer")]
    for s in (0, 1, 4):
        assert ("push", "Net") in steps[s] and ("start", "backward") in steps[s]


def test_gradient_accumulation_and_checkpointing(domain: FakeDomain) -> None:
    # Two micro-batches a step, each layer checkpointed: the recomputed forward runs inside the
    # backward pass, gets its forward ranges there, and does not end the backward phase.
    coll = nvtxranges.NvtxCollector()
    _run(Net(ckpt=True), ProfileSession(steps=1, warmup=1, collectors=[coll]), micro=2)
    steps = _by_step(domain.log)
    assert sorted(steps) == [0, 1]
    for events in steps.values():
        _assert_balanced(events)
        phases = [name for op, name in events if op == "start" and domain.categories[name] == "phase"]
        assert phases == ["forward", "backward", "forward", "backward", "optimizer"]
        backward = events[events.index(("start", "backward")) : events.index(("end", "backward"))]
        assert ("push", "layers.1") in backward or ("push", "Block") in backward


def test_early_stopping_recomputation_stays_balanced(domain: FakeDomain) -> None:
    # Non-reentrant checkpointing stops the recomputed forward by raising once the tensors backward
    # needs exist; the session's post hook runs for a forward that raises too (always_call), so each
    # recomputation's ranges close where it stops, before the next one begins.
    coll = nvtxranges.NvtxCollector()
    _run(Net(ckpt=False), ProfileSession(steps=1, warmup=1, collectors=[coll]), iters=2)
    _assert_balanced([e for e in domain.log if not e[1].startswith("step ")])
    first = domain.log[: domain.log.index(("end", "backward"))]
    recomputed = first[first.index(("start", "backward")) :]
    assert recomputed.count(("push", "Block")) == 2 == recomputed.count(("pop", "Block"))
    second = domain.log[len(first) + 1 :]
    second = second[second.index(("start", "backward")) : second.index(("end", "backward"))]
    pushes = [i for i, e in enumerate(second) if e == ("push", "layers.0")]
    assert len(pushes) == 1 and second.count(("pop", "layers.0")) == 1
    assert second.index(("pop", "layers.1")) < pushes[0]


def test_without_a_tool_nothing_is_asked_of_the_hot_path() -> None:
    # The real nvtx package, no Nsight attached: a dummy domain, so no module calls are requested.
    records: list[dict[str, Any]] = []
    coll = nvtxranges.NvtxCollector()
    assert not coll.attached and not coll.wants_modules
    session = ProfileSession(steps=1, warmup=0, sink=records.append, collectors=[coll])
    assert session._mod_collectors == ()
    _run(Net(), session)
    assert _record(records)["emitted"] is False


def test_missing_package_is_a_not_measured_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx raises ImportError
    with pytest.raises(CollectorUnavailable, match="pip install nvtx"):
        nvtxranges.NvtxCollector()
    made, notes = make_collectors(["nvtx"], device=FakeDevice())
    assert made == [] and notes == ["nvtx: nvtx package not installed: pip install nvtx"]


def test_report_note_says_how_to_see_the_ranges() -> None:
    trace = completed_trace(layers=2)
    assert nvtx_note.report_note(trace) is None  # no nvtx record (--collect left it out, old trace)
    assert report_context(trace, build_summary(trace))["nvtx"] is None
    trace.collected["nvtx"] = {"emitted": False, "domain": "memdoctor", "version": "0.2.17"}
    note = nvtx_note.report_note(trace)
    assert note is not None and note["emitted"] is False and "nsys profile" in note["command"]
    assert 'id="nvtx"' in render_report(trace)
    trace.collected["nvtx"]["emitted"] = True
    assert report_context(trace, build_summary(trace))["nvtx"]["emitted"] is True
