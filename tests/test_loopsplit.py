"""Micro-batching on every common loop shape: gradients after one step equal the unsplit run's (fp32).

In-process (``install`` applied to tiny models and loops written here, then ``remove``): the loss in
the forward's output as a tuple (last, as minimal GPT trainers return it), a dict, a dataclass and HF's
``ModelOutput``; the loss computed by the loop, split at the DataLoader (batches of tensors, tuples,
lists, dicts; an uneven split; LR scheduler and GradScaler deferral); sequence-first batches.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.capture.loopshape import batch_dim, find_loss, loss_fact
from memdoctor.errors import ConfigError
from memdoctor.levers.apply import split_batch
from memdoctor.levers.install import Installation, install

TOL = 1e-5


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class LikeModelOutput(OrderedDict):  # type: ignore[type-arg]
    """The shape of HF's ``ModelOutput`` (a dataclass that is also an ordered mapping of its set
    fields, an item set also setting the attribute), without importing transformers (seconds)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        for k, v in fields.items():
            self[k] = v

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


class Net(nn.Module):
    """A tiny classifier whose forward returns its loss in the shape ``kind`` names."""

    def __init__(self, kind: str = "tensor") -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        logits = self.body(x)
        if y is None:
            return logits
        loss = nn.functional.cross_entropy(logits, y)
        return _shaped(self.kind, logits, loss)


def _shaped(kind: str, logits: torch.Tensor, loss: torch.Tensor) -> Any:
    if kind == "tuple_last":
        return logits, loss
    if kind == "tuple_first":
        return loss, logits
    if kind == "dict":
        return {"logits": logits, "loss": loss}
    if kind == "dataclass":
        return Out(logits, loss)
    if kind == "model_output":
        return LikeModelOutput(loss=loss, logits=logits)
    return loss


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and got
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


def _installed(config: dict[str, Any]) -> tuple[Installation, list[str]]:
    lines: list[str] = []
    return install({"memdoctor_config": 1, **config}, say=lines.append), lines


def _twin(kind: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = Net(kind)
    b = Net(kind)
    b.load_state_dict(a.state_dict())
    return a, b


# ----------------------------------------------------------------------------------------- in the forward


@pytest.mark.parametrize("kind", ["tensor", "tuple_last", "tuple_first", "dict", "dataclass", "model_output"])
def test_in_forward_split_finds_the_loss_and_keeps_the_gradients(kind: str) -> None:
    ref, model = _twin(kind)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    out = ref(x, y)
    want_loss = find_loss(out).loss
    assert want_loss is not None
    want_loss.backward()
    inst, lines = _installed({"accumulation_steps": 4})  # 10 / 4: uneven micro-batches
    try:
        torch.optim.SGD(model.parameters(), lr=0.1)  # the model is found when its optimizer is built
        got = model(x, y)
        loss = find_loss(got).loss
        assert loss is not None
        torch.testing.assert_close(loss, want_loss.detach(), rtol=TOL, atol=TOL)
        loss.backward()
    finally:
        inst.remove()
    assert any("inside Net.forward" in line for line in lines)
    _close(_grads(model), _grads(ref))
    if kind != "tensor":  # the other outputs hold the whole batch again
        logits = got["logits"] if kind in ("dict", "model_output") else getattr(got, "logits", None)
        logits = logits if logits is not None else got[0 if kind == "tuple_last" else 1]
        assert logits.shape == (10, 3)
        torch.testing.assert_close(logits, ref(x), rtol=TOL, atol=TOL)


def test_two_unnamed_scalars_are_ambiguous_and_named() -> None:
    w = torch.ones(1, requires_grad=True)
    found = find_loss((torch.zeros(3), (w * 2).sum(), (w * 3).sum()))
    assert found.loss is None and found.ambiguous is not None and "[1], [2]" in found.ambiguous
    assert loss_fact({"logits": torch.zeros(2, 3)})["in_forward"] is False
    assert loss_fact({"loss": (w * 2).sum()}) == {"in_forward": True, "at": "['loss']", "why": None}


def test_a_forward_without_a_loss_stops_with_one_line() -> None:
    model = Net("tensor")
    inst, _ = _installed({"accumulation_steps": 2})
    try:
        torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match="accumulation_steps: the model's forward returns no loss"):
            model(torch.randn(4, 6))
    finally:
        inst.remove()


# ----------------------------------------------------------------------------------------- batch dimension


def test_sequence_first_batches_split_along_the_batch_dimension() -> None:
    src, tgt, lengths = torch.randn(7, 4, 2), torch.randn(5, 4), torch.arange(4)
    assert batch_dim((src, tgt)) == 1
    parts = list(split_batch((src, tgt, lengths), 2, size=4))
    assert [p[0].shape for p, _ in parts] == [(7, 2, 2), (7, 2, 2)]
    assert [p[2].tolist() for p, _ in parts] == [[0, 1], [2, 3]]
    torch.testing.assert_close(torch.cat([p[1] for p, _ in parts], dim=1), tgt)
    with pytest.raises(ConfigError, match="has no dimension of the batch size"):
        list(split_batch((src, torch.zeros(28)), 2, size=4))  # a flattened [seq * batch] target


class SeqFirst(nn.Module):
    """An RNN over ``[seq, batch, feature]`` inputs that returns its loss (batch along dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = self.rnn(x)
        logits = self.head(out[-1])  # [batch, 2]
        return logits, nn.functional.cross_entropy(logits, y)


def test_in_forward_split_of_sequence_first_inputs_keeps_the_gradients() -> None:
    torch.manual_seed(0)
    ref, model = SeqFirst(), SeqFirst()
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(9, 6, 3), torch.randint(0, 2, (6,))
    ref(x, y)[1].backward()
    inst, _ = _installed({"accumulation_steps": 3, "micro_batch": 2})
    try:
        torch.optim.SGD(model.parameters(), lr=0.1)
        model(x, y)[1].backward()
    finally:
        inst.remove()
    _close(_grads(model), _grads(ref))


# ----------------------------------------------------------------------------------------- at the DataLoader


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """20 samples, each shaped as ``kind`` says (the default collate keeps the shape per batch)."""

    def __init__(self, kind: str) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g)
        self.kind = kind

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        if self.kind == "tensor":
            return self.x[i]
        if self.kind == "dict":
            return {"x": self.x[i], "y": self.y[i]}
        return self.x[i], self.y[i]  # collated to a list; "tuple" collates to a tuple (below)


def _loader(kind: str) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    collate = None
    if kind == "tuple":

        def collate(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    return torch.utils.data.DataLoader(Samples(kind), batch_size=10, collate_fn=collate)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return model(batch).pow(2).mean()
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return nn.functional.cross_entropy(model(x), y)


def _train(model: nn.Module, kind: str, zero_first: bool, scaler: bool) -> dict[str, Any]:
    """A plain loop computing the loss itself: clipping, a StepLR, a GradScaler(enabled=False)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    amp = torch.amp.GradScaler("cpu", enabled=False) if scaler else None
    steps, iterations, grads = [0], 0, []
    opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    model.zero_grad()
    for batch in _loader(kind):
        iterations += 1
        if zero_first:
            opt.zero_grad()
        loss = _loss(model, batch)
        (amp.scale(loss) if amp is not None else loss).backward()
        if amp is not None:
            amp.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        grads = _grads(model) if zero_first else grads
        sched.step()
        if not zero_first:
            opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "steps": steps[0],
        "iterations": iterations,
        "lr": sched.get_last_lr(),
        "params": params,
        "grads": grads,
    }


@pytest.mark.parametrize(
    ("kind", "zero_first", "scaler"),
    [("tensor", True, False), ("tuple", False, True), ("list", True, True), ("dict", False, False)],
)
def test_loader_split_keeps_steps_schedule_and_gradients(kind: str, zero_first: bool, scaler: bool) -> None:
    ref, model = _twin("tensor")
    want = _train(ref, kind, zero_first, scaler)
    inst, lines = _installed({"accumulation_steps": 4, "accumulation_split": "loader"})  # 10 / 4: uneven
    try:
        got = _train(model, kind, zero_first, scaler)
        notes = inst.finish()
    finally:
        inst.remove()
    assert any("each training DataLoader batch split into 4" in line for line in lines)
    assert not any("NOT applied" in n for n in notes)
    assert got["iterations"] == 8 and want["iterations"] == 2  # the body runs once per micro-batch
    assert got["steps"] == want["steps"] == 2 and got["lr"] == want["lr"]
    _close(got["params"], want["params"])
    if zero_first:
        _close(got["grads"], want["grads"])


def test_loader_split_leaves_evaluation_batches_whole() -> None:
    model = Net()
    inst, _ = _installed({"accumulation_steps": 2, "accumulation_split": "loader"})
    try:
        torch.optim.SGD(model.parameters(), lr=0.1)
        model.eval()
        with torch.no_grad():
            sizes = [len(b) for b in _loader("tensor")]
    finally:
        inst.remove()
    assert sizes == [10, 10]


def test_a_hand_updated_model_stops_the_loader_split_by_name() -> None:
    model = Net()
    fails: list[str] = []
    inst = install(
        {"memdoctor_config": 1, "accumulation_steps": 2, "accumulation_split": "loader"},
        say=lambda _: None,
        fail=fails.append,
    )
    try:
        for batch in _loader("tensor"):
            model.zero_grad()
            _loss(model, batch).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    finally:
        inst.remove()
    assert fails and "without a torch.optim optimizer step" in fails[0]


# ----------------------------------------------------------------------------------------- the script's knobs


def test_script_arguments_are_added_to_the_parse_that_knows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from memdoctor.capture.knobs import knobs_of

    def parser() -> Any:
        import argparse

        p = argparse.ArgumentParser()
        p.add_argument("--batch-size", type=int, default=12)
        p.add_argument("--gradient_accumulation_steps", type=int, default=1)
        p.add_argument("--lr", type=float, default=0.1)
        return p

    monkeypatch.setattr("sys.argv", ["train.py", "--lr", "0.5"])
    config = {"accumulation_steps": 4, "accumulation_split": "arguments"}
    args = ["--batch-size", "3", "--gradient_accumulation_steps", "4"]
    inst, lines = _installed({**config, "script_args": args})
    try:
        ns = parser().parse_args()
        other = __import__("argparse").ArgumentParser()
        other.add_argument("--lr", type=float)
        assert other.parse_args(["--lr", "1"]).lr == 1.0  # a parser without the options: untouched
        notes = inst.finish()
    finally:
        inst.remove()
    assert (ns.batch_size, ns.gradient_accumulation_steps, ns.lr) == (3, 4, 0.5)
    assert any("--batch-size 3 --gradient_accumulation_steps 4" in line for line in lines)
    assert not notes
    knobs = knobs_of(parser(), parser().parse_args([]))
    assert (knobs.batch_option, knobs.batch_value) == ("--batch-size", 12)
    assert (knobs.accumulation_option, knobs.accumulation_value) == ("--gradient_accumulation_steps", 1)


# ------------------------------------------------------------------------------------- what profile records


def _profiled_loop(collate: Any, own_loss: bool) -> list[dict[str, Any]]:
    """A loop over a DataLoader under a profiling session, after an argparse parse of its knobs."""
    import argparse

    from memdoctor.capture.dataloader import DataCollector
    from memdoctor.capture.session import ProfileSession

    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[DataCollector()])
    model = Net("tuple_last")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with session:
        p = argparse.ArgumentParser()
        p.add_argument("--batch_size", type=int, default=10)
        p.add_argument("--grad-accum", type=int, default=2)
        p.parse_args([])
        loader = torch.utils.data.DataLoader(Samples("list"), batch_size=10, collate_fn=collate)
        for x, y in loader:
            if own_loss:
                loss = model(x, y)[1]
            else:
                loss = nn.functional.cross_entropy(model(x.t() if x.shape[0] != 10 else x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    return records


def _data(records: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    facts = [r["data"] for r in records if r["type"] == "collector" and r["name"] == "data"][-1]
    steps = [r["collectors"]["data"] for r in records if r["type"] == "step" and r.get("collectors")]
    return facts, [b for s in steps if s for b in s.get("batches", [])]


def test_profile_records_the_loop_shape_and_the_measured_batch_dimension() -> None:
    from types import SimpleNamespace

    from memdoctor.plan.splits import split_of

    def seq_first(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([a for a, _ in items]).t(), torch.stack([b for _, b in items])  # [6, batch]

    facts, batches = _data(_profiled_loop(seq_first, own_loss=False))
    loop = facts["loop"]
    assert loop["loss"]["in_forward"] is False and loop["loader"] and loop["torch_optim"]
    assert loop["knobs"] == {
        "batch_option": "--batch_size",
        "batch_value": 10,
        "accumulation_option": "--grad-accum",
        "accumulation_value": 2,
        "style": "argparse",
    }
    assert batches and all((b["batch_size"], b["batch_dim"]) == (10, None) for b in batches)  # [6,10] + [10]
    # the script's own arguments first (its loop then runs each micro-batch), else the loader's split
    assert split_of(SimpleNamespace(collected={"data": facts})).kind == "arguments"
    bare = {**facts, "loop": {**loop, "knobs": {}}}
    assert split_of(SimpleNamespace(collected={"data": bare})).kind == "loader"
    facts, batches = _data(_profiled_loop(None, own_loss=True))
    assert facts["loop"]["loss"] == {"in_forward": True, "at": "[1]", "why": None}
    assert all((b["batch_size"], b["batch_dim"]) == (10, 0) for b in batches)
    assert split_of(SimpleNamespace(collected={"data": facts})).kind == "arguments"
    bare = {**facts, "loop": {**facts["loop"], "knobs": {}}}
    assert split_of(SimpleNamespace(collected={"data": bare})).kind == "forward"


def test_the_planner_knows_which_split_applies_before_proposing_it() -> None:
    from types import SimpleNamespace

    from memdoctor.plan.splits import split_of

    outside = {"in_forward": False, "at": None, "why": "the loop computes it"}
    knobs = {
        "batch_option": "--batch_size",
        "batch_value": 12,
        "accumulation_option": "--gas",
        "accumulation_value": 2,
    }

    def split(loop: dict[str, Any], lookahead: int | None = None) -> Any:
        return split_of(SimpleNamespace(collected={"data": {"lookahead": lookahead, "loop": loop}}))

    args = split({"loss": outside, "loader": False, "torch_optim": True, "knobs": knobs})
    assert args.kind == "arguments" and args.script_args(4) == ["--batch_size", "3", "--gas", "8"]
    assert args.allows(4) and not args.allows(8)
    none = split({"loss": outside, "loader": False, "torch_optim": False, "knobs": None})
    assert none.kind is None and not none.allows(2) and none.allows(1)
    assert none.why_not is not None and "batches do not come from a DataLoader" in none.why_not
    one_ahead = split({"loss": outside, "loader": True, "torch_optim": True, "knobs": None}, lookahead=1)
    assert one_ahead.kind == "loader"  # accelerate's prepared loader: the split follows it
    ahead = split({"loss": outside, "loader": True, "torch_optim": True, "knobs": None}, lookahead=2)
    assert ahead.kind is None and ahead.why_not is not None and "2 batches ahead" in ahead.why_not
    own = split({"loss": outside, "loader": True, "torch_optim": True, "accelerate_accumulation": 4}, 1)
    assert own.kind is None and "accelerate (gradient_accumulation_steps=4)" in (own.why_not or "")
    assert split_of(SimpleNamespace(collected={})).kind == "forward"  # an older trace: as before


def test_a_short_last_batch_keeps_the_full_batch_layout() -> None:
    """Batch 8 of sequences of 6, then a last batch of 6 sequences of 8: split along dim 0 both times."""
    from memdoctor.capture.loopshape import batch_layout

    size, dims = batch_layout(torch.zeros(8, 6), 8, None)
    assert (size, dims) == (8, [0])
    short = torch.arange(48.0).reshape(6, 8)
    assert batch_layout(short, 8, None) == (8, [1])  # from its shape alone: the wrong dimension
    assert batch_layout(short, 8, dims) == (6, [0])  # with the full batch's layout: the right one
    parts = list(split_batch(short, 2, 6, [0]))
    assert [p.shape for p, _ in parts] == [(3, 8), (3, 8)]
