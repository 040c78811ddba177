"""Training loops of every common shape give whole steps and possible module times, in this process.

Scripts without ``torch.optim`` (parameters updated by hand, pytorch/examples' word_language_model and
regression) get their steps from backward passes and parameter updates; a dcgan-shaped loop steps two
optimizers a step; LBFGS calls its closure, a forward and a backward, several times inside one optimizer
step. Every step's module times must be possible: no module longer than its parent or its step. And
the plan names the modules of one model, which ``memdoctor run`` finds by its provenance, whatever order
the script builds its models in.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.analysis.steps import steps_found
from memdoctor.capture.session import ProfileSession
from memdoctor.capture.stepbuild import Sample, StepData, build_step
from memdoctor.device import FakeDevice
from memdoctor.levers.install import install
from memdoctor.levers.targets import describes
from memdoctor.plan.planner import make_plan
from memdoctor.plan.target import Target
from memdoctor.plan.tiers import tier_one, tier_two
from memdoctor.trace import ModelInfo, StepRecord, Trace
from tests.test_plan import hand_workload

Loop = Callable[[ProfileSession], None]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _profile(
    loop: Callable[[ProfileSession], None], steps: int = 3, **kw: Any
) -> tuple[ProfileSession, list[Any]]:
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=steps, warmup=1, sink=records.append, **kw)
    torch.manual_seed(0)
    with session:
        loop(session)
    return session, records


def _final_steps(records: list[dict[str, Any]]) -> list[StepRecord]:
    """The final record of each step (a provisional one is replaced by the step's last)."""
    final = {r["step"]: r for r in records if r["type"] == "step"}
    return [StepRecord.from_record(final[k]) for k in sorted(final)]


def _collected(records: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    found = [r["data"] for r in records if r["type"] == "collector" and r["name"] == name]
    return found[-1] if found else None


def _impossible(session: ProfileSession, steps: list[StepRecord]) -> list[str]:
    """Every module time longer than its parent's or its step's."""
    parents = {m.info.index: (m.info.parents, m.info.names) for m in session.models}
    bad = []
    for st in steps:
        for model, cols in st.modules.items():
            up, names = parents[model]
            for col in ("forward_ms", "backward_ms"):
                v = cols[col]
                for i, ms in enumerate(v):
                    if ms is None:
                        continue
                    if st.duration_ms is not None and ms > st.duration_ms + 1e-6:
                        bad.append(f"step {st.step} {names[i]} {col} {ms} > step {st.duration_ms}")
                    p = up[i]
                    if p >= 0 and v[p] is not None and ms > v[p] + 1e-6:
                        bad.append(f"step {st.step} {names[i]} {col} {ms} > parent {v[p]}")
    return bad


# ----------------------------------------------------------------------------------------- by hand


def _by_hand(update: str, iterations: int = 8, micro: int = 1, evaluate: bool = False) -> Loop:
    """word_language_model's loop: zero_grad, forward, backward, then each parameter updated by hand
    (``update``: "data" through ``p.data``, "no_grad" in place under ``torch.no_grad()``);
    ``micro`` forwards and backwards per update; ``evaluate``: a no-grad forward after each update."""

    def loop(session: ProfileSession) -> None:
        model = Net()
        for _ in range(iterations):
            if update != "zero_after_forward":
                model.zero_grad()
            for _ in range(micro):
                out = model(torch.randn(4, 8))
                if update == "zero_after_forward":
                    model.zero_grad(set_to_none=False)
                (out**2).mean().backward()
            if update == "no_grad":
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad  # type: ignore[operator]
            else:
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)  # type: ignore[arg-type]
            if evaluate:
                with torch.no_grad():
                    model(torch.randn(2, 8))
            if session._done:
                break

    return loop


@pytest.mark.parametrize("update", ["data", "no_grad", "zero_after_forward"])
def test_a_loop_without_an_optimizer_gets_its_steps_from_backward(update: str) -> None:
    session, records = _profile(_by_hand(update))
    steps = _final_steps(records)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.complete and s.micro_batches == 1 for s in steps)
    assert _collected(records, "steps") == {"found_by": "backward"}
    models = [r for r in records if r["type"] == "model"]
    assert [m["class"] for m in models] == ["Net"] and models[0]["optimizers"] == []
    profiled = [s for s in steps if not s.warmup]
    # The gradients the backward made, though zero_grad() reset them before the step ended.
    assert all(
        sum(s.modules[0]["grad_bytes"])
        == 4 * sum(p.numel() for p in session.models[0].modules[0].parameters())
        for s in profiled
    )
    assert all(s.timeline["event"][-1] == "step_end" for s in profiled)
    assert not _impossible(session, steps)


def test_gradient_accumulation_by_hand_is_one_step_of_several_micro_batches() -> None:
    _, records = _profile(_by_hand("data", micro=3))
    steps = _final_steps(records)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert [s.micro_batches for s in steps] == [3, 3, 3, 3]


def test_a_no_grad_evaluation_between_updates_is_not_a_step() -> None:
    _, records = _profile(_by_hand("data", evaluate=True))
    steps = _final_steps(records)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert [s.micro_batches for s in steps] == [1, 1, 1, 1]


def test_the_last_step_of_a_script_that_ends_after_its_update_is_recorded() -> None:
    _, records = _profile(_by_hand("data", iterations=3), steps=5)
    assert [s.step for s in _final_steps(records)] == [0, 1, 2]


def test_an_optimizer_loop_says_its_steps_are_optimizer_steps() -> None:
    def loop(session: ProfileSession) -> None:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            for _ in range(2):  # accumulation before the first optimizer step: not a step by hand
                (model(torch.randn(4, 8)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    _, records = _profile(loop)
    assert _collected(records, "steps") == {"found_by": "optimizer"}
    assert [s.micro_batches for s in _final_steps(records)] == [2, 2, 2, 2]


# ----------------------------------------------------------------------------------------- closures


class Sequence(nn.Module):
    """time_sequence_prediction's shape: an LSTM cell unrolled over the sequence, float64."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, 8)
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(0), 8, dtype=x.dtype)
        c = torch.zeros(x.size(0), 8, dtype=x.dtype)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outputs.append(self.linear(h))
        return torch.cat(outputs, dim=1)


def _lbfgs(session: ProfileSession) -> None:
    data = torch.sin(torch.linspace(0, 6, 11, dtype=torch.float64) + torch.rand(4, 1, dtype=torch.float64))
    x, y = data[:, :-1], data[:, 1:]
    model = Sequence().double()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=4)
    for _ in range(6):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.step(closure)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            model(x[:1])
        if session._done:
            break


def test_lbfgs_closure_calls_are_micro_batches_of_one_step_with_possible_times() -> None:
    session, records = _profile(_lbfgs)
    steps = _final_steps(records)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.micro_batches > 1 for s in steps)  # the closure ran several times in each step
    cols = steps[-1].modules[0]
    names = session.models[0].info.names
    assert cols["backward_ms"][names.index("cell")] is not None, "the cell's backward is timed"
    assert not _impossible(session, steps)
    # LBFGS's own work between its closure calls is the optimizer's, not "other".
    assert all(s.phases_ms["optimizer"] > 0 for s in steps)


def test_the_timing_depth_is_chosen_per_forward() -> None:
    """20 cell calls a forward, 5 forwards a step: the cells are timed (budget 96 a forward)."""
    session, _ = _profile(_lbfgs)
    assert session.time_depth == 1


# ----------------------------------------------------------------------------------------- GANs


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def _dcgan(session: ProfileSession) -> None:
    """dcgan's iteration: the discriminator's two backwards (real, fake) and its step, then the
    generator's forward through the discriminator after that step, its backward and step."""
    net_g, net_d = Generator(), Discriminator()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4)
    bce = nn.BCELoss()
    for _ in range(12):
        ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
        net_d.zero_grad()
        bce(net_d(torch.randn(8, 8)), ones).backward()
        fake = net_g(torch.randn(8, 4))
        bce(net_d(fake.detach()), zeros).backward()
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), ones).backward()
        opt_g.step()
        if session._done:
            break


def test_dcgan_steps_both_optimizers_in_one_step() -> None:
    session, records = _profile(_dcgan, steps=4)
    steps = _final_steps(records)
    # The first iteration is two steps until the discriminator steps again (tests/test_optimizers.py):
    # both warm-up; then one step per iteration, each with both optimizers' state.
    assert [s.warmup for s in steps] == [True, True, False, False, False, False]
    assert sorted(m.info.cls for m in session.models) == ["Discriminator", "Generator"]
    for st in steps[2:]:
        assert st.micro_batches == 3  # the discriminator's real and fake passes, the generator's
        assert all(sum(cols["optimizer_state_bytes"]) > 0 for cols in st.modules.values())
    assert not _impossible(session, steps)


def test_steps_found_says_how_for_each_shape() -> None:
    def trace(found_by: str | None, optimizers: list[str]) -> Trace:
        info = ModelInfo(
            index=0,
            cls="M",
            names=[""],
            types=["M"],
            parents=[-1],
            param_bytes=[4],
            param_counts=[1],
            trainable_param_bytes=[4],
            optimizers=[{"class": c} for c in optimizers],
        )
        collected = {"steps": {"found_by": found_by}} if found_by else {}
        return Trace(header={}, models=[info], steps=[], events=[], end=None, collected=collected)

    assert steps_found(trace(None, ["AdamW"])) == {
        "by": "optimizer",
        "how": "at each optimizer step (AdamW)",
        "optimizers": ["AdamW"],
    }  # a trace from before the record
    two = steps_found(trace("optimizer", ["Adam", "SGD"]))
    assert two is not None and "last of its 2 optimizers (Adam, SGD)" in two["how"]
    hand = steps_found(trace("backward", []))
    assert hand is not None and hand["by"] == "backward" and "by hand" in hand["how"]
    assert steps_found(trace(None, [])) is None


# ----------------------------------------------------------------------------------------- module times


def _samples(events: list[tuple[str, int | None, int]]) -> list[Sample]:
    return [Sample(float(i), e, k, d, 0, 0, 0, 0, None) for i, (e, k, d) in enumerate(events)]


def test_a_child_sharing_its_parents_tensors_is_not_longer_than_it() -> None:
    """Parent 1 and its only child 2 share the output tensor: the child's backward hook fires first."""
    data = StepData(step=0)
    forward = [
        ("step_start", None, 0),
        ("fwd_pre", 1, 0),
        ("fwd_pre", 2, 1),
        ("fwd_post", 2, 1),
        ("fwd_post", 1, 0),
    ]
    backward = [
        ("bwd_pre", 2, 1),
        ("bwd_pre", 1, 0),
        ("bwd_post", 1, 0),
        ("bwd_post", 2, 1),
        ("opt_post", None, 0),
    ]
    data.samples = _samples([*forward, *backward])
    data.fwd_pairs = [(2, 2, 3), (1, 1, 4)]
    data.bwd_pairs = [(2, 5, 8), (1, 6, 7)]

    class Ms(FakeDevice):
        def resolve_ms(self, markers: list[Any]) -> list[float]:
            return [float(m) for m in markers]

    rec = build_step(
        data,
        upto=10,
        device=Ms(),
        index={1: (0, 0), 2: (0, 1)},
        warmup=False,
        complete=True,
        parents={0: [-1, 0]},
    )
    cols = rec.modules[0]
    assert cols["backward_ms"] == [3.0, 3.0] and cols["forward_ms"] == [3.0, 1.0]


def test_backward_spans_left_open_close_at_the_end_of_their_own_pass() -> None:
    """Two passes (a closure called twice): a span left open in the first ends there, and does not pair
    with the second pass's first backward end."""
    data = StepData(step=0)
    data.samples = _samples(
        [("fwd_pre", 1, 0), ("fwd_post", 1, 0), ("bwd_pre", 1, 0), ("bwd_pre", 1, 0), ("bwd_post", 1, 0)]
    )
    data.bwd_open = {1: [2, 3]}
    data.bwd_open[1].pop(0)  # the later call ended at sample 4 (pairs FIFO: the earlier stays open)
    data.bwd_pairs = [(1, 2, 4)]
    data.close_backward_pass()
    assert data.bwd_pairs == [(1, 2, 4), (1, 3, 4)] and data.bwd_open == {1: []}


# ----------------------------------------------------------------------------------------- the plan


def test_no_optimizer_lever_is_searched_without_an_optimizer() -> None:
    w = hand_workload(has_optimizer=False, optimizer_state=0, peak_bytes=800)
    target = Target(budget_bytes=500)
    assert {c.optimizer for c in tier_one(w, target) + tier_two(w, target)} == {"as-is"}
    plan = make_plan(w, target)
    assert (plan.chosen or plan.closest).config.optimizer == "as-is"
    with_opt = hand_workload()
    assert "offload" in {c.optimizer for c in tier_one(with_opt, target)}


def test_no_optimizer_lever_is_searched_for_a_closure_optimizer() -> None:
    """LBFGS evaluates its closure several times a step: ``memdoctor run`` refuses ``optimizer: offload``
    for it (pytorch/examples' time_sequence_prediction was planned so, then refused), so the planner
    never proposes it; the class comes from the trace (``steps_found.optimizers``)."""
    target = Target(budget_bytes=500)
    w = hand_workload(optimizer_classes=("LBFGS",), peak_bytes=800)
    assert {c.optimizer for c in tier_one(w, target) + tier_two(w, target)} == {"as-is"}
    adam = hand_workload(optimizer_classes=("AdamW",), peak_bytes=800)
    assert {"offload", "8bit"} <= {c.optimizer for c in tier_one(adam, target) + tier_two(adam, target)}


def test_the_run_finds_the_planned_model_by_its_provenance_not_its_order() -> None:
    g, d = Generator(), Discriminator()
    assert [n for n, _ in g.named_modules()][:3] == [n for n, _ in d.named_modules()][:3]  # main.0 in both
    count = sum(p.numel() for p in d.parameters())
    assert describes(d, "Discriminator", 6, count)
    assert not describes(g, "Discriminator", 6, count)
    assert not describes(d, "Discriminator", 6, count + 1)  # same class, another size
    assert describes(g, None, None, None)  # a plan from before the provenance: any model


def test_run_finds_the_model_of_a_script_without_an_optimizer_at_its_first_forward() -> None:
    """loop_by_hand.py builds no optimizer: the model is the first top-level module called with
    gradients on that the plan describes; checkpointing wraps its submodules before they run."""
    script = Path(__file__).parent / "scripts" / "loop_by_hand.py"
    lines: list[str] = []
    config = {
        "memdoctor_config": 1,
        "checkpoint": ["body"],
        "precision": "bf16",
        "provenance": {"model_class": "Net", "module_count": 7, "param_count": 433},
    }
    inst = install(config, say=lines.append)
    argv = sys.argv
    try:
        sys.argv = [str(script), "--steps", "2"]
        runpy.run_path(str(script), run_name="__main__")
        notes = inst.finish()
    finally:
        sys.argv = argv
        inst.remove()
    assert inst.model is not None and type(inst.model).__name__ == "Net"
    assert "checkpointing 1 modules of Net: body" in lines
    assert any("found at its first forward" in line for line in lines)
    assert not notes
