"""Full offload (``full_offload: true``): FSDP2 ``fully_shard`` with ``CPUOffloadPolicy`` on one process,
applied to an unmodified loop (``memdoctor.levers.install``) and in code (``memdoctor.apply``). On a CPU
FSDP2 runs with a gloo group of one process (unpinned host memory), so the gradients and the updated
parameters are compared with the unsharded run's here; the planner's side is in test_plan_full_offload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memdoctor
from memdoctor.config import parse_config
from memdoctor.errors import ConfigError
from memdoctor.levers.install import install
from memdoctor.levers.modnames import class_name
from memdoctor.levers.offload_full import shard_units
from tests.test_run import ACCELERATE, memdoctor_cli, run_script

VOCAB, WIDTH = 11, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.fc(x)))


class Decoder(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (world size 1: its local shard), else the tensor."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


Tensors = dict[str, torch.Tensor]


def _train(steps: int = 2, build: Any = None) -> tuple[Tensors, Tensors, nn.Module]:
    """The unmodified loop: model, AdamW over model.parameters(), ``steps`` steps. Returns the first
    step's gradients and the parameters after the last step."""
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if build is not None:
        build(model, opt)
    ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        _loss(model, ids).backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return grads, {n: _full(p) for n, p in model.named_parameters()}, model


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    grads, params, _ = _train()
    return grads, params


def test_run_path_shards_before_the_optimizer_and_matches_the_unmodified_run(reference: Any) -> None:
    inst = install({"memdoctor_config": 1, "full_offload": True, "provenance": {"model_class": "Decoder"}})
    try:
        grads, params, model = _train()
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert class_name(model) == "Decoder" and type(model).__name__ == "FSDPDecoder"
    finally:
        inst.remove()
    assert not dist.is_initialized()  # the group memdoctor made is gone with the plan
    assert any(line.startswith("full_offload: Decoder sharded") for line in inst.lines)
    _same(reference[0], grads)
    _same(reference[1], params)


def test_a_sharded_model_is_still_the_model_the_provenance_describes(reference: Any) -> None:
    """FSDP2 swaps the model's class for ``FSDP<name>``: a plan made by a profile (its provenance names
    the class, module and parameter counts) must still find its model at the optimizer's build, before
    the first forward. On the H200 the 1.1B decoder's plan (full offload + bf16) was matched only at the
    first optimizer step, after the forward had run without autocast, and the run stopped."""
    plain = Decoder()
    count = sum(1 for _ in plain.named_modules())
    params = sum(p.numel() for p in plain.parameters())
    provenance = {"model_class": "Decoder", "module_count": count, "param_count": params}
    config = {"memdoctor_config": 1, "full_offload": True, "precision": "bf16", "provenance": provenance}
    inst = install(config)
    try:
        _, trained, model = _train()
    finally:
        inst.remove()
    assert inst.model is model and type(model).__name__ == "FSDPDecoder"
    assert any(line == "autocast bf16 around FSDPDecoder.forward" for line in inst.lines)
    assert not any("the config was made for" in line for line in inst.lines)
    assert trained.keys() == reference[1].keys()


def test_full_offload_with_checkpointing_matches(reference: Any) -> None:
    config = {"memdoctor_config": 1, "full_offload": True, "checkpoint": ["blocks.0", "blocks.2"]}
    inst = install(config)
    try:
        grads, params, _ = _train()
    finally:
        inst.remove()
    assert any(line.startswith("checkpointing 2 modules of Decoder") for line in inst.lines)
    _same(reference[0], grads)
    _same(reference[1], params)


def test_apply_shards_a_built_optimizer_in_place(reference: Any) -> None:
    cfg = parse_config("memdoctor_config: 1\nfull_offload: true\n")
    grads, params, _ = _train(build=lambda model, opt: memdoctor.apply(cfg, model, opt))
    try:
        _same(reference[0], grads)
        _same(reference[1], params)
    finally:
        dist.destroy_process_group()  # apply's group lives to exit; this test ends it


def test_apply_after_the_first_step_is_refused() -> None:
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, torch.zeros(2, 3, dtype=torch.long)).backward()
    opt.step()
    cfg = parse_config("memdoctor_config: 1\nfull_offload: true\n")
    with pytest.raises(ConfigError, match="already stepped"):
        memdoctor.apply(cfg, model, opt)
    assert not dist.is_initialized()


def _grouped(model: nn.Module) -> torch.optim.Optimizer:
    """Param groups as HF scripts build them: no weight decay for biases and norms."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and "norm" not in n)]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _named(model: nn.Module) -> torch.optim.Optimizer:
    """torch >= 2.6 optimizers take ``named_parameters()``: (name, parameter) pairs."""
    return torch.optim.AdamW(model.named_parameters(), lr=1e-2)


def _train_grouped(build: Any = _grouped) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Decoder()
    opt = build(model)
    ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    return {n: _full(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [_grouped, _named], ids=["param-groups", "named-parameters"])
def test_param_groups_and_named_parameters_keep_their_settings(build: Any) -> None:
    expected = _train_grouped(build)
    inst = install({"memdoctor_config": 1, "full_offload": True})
    try:
        got = _train_grouped(build)
    finally:
        inst.remove()
    assert any(line.startswith("full_offload:") for line in inst.lines)
    _same(expected, got)


def test_units_are_the_blocks_and_a_tied_pair_stays_with_the_root() -> None:
    model = Decoder()
    assert shard_units(model) == list(model.blocks)
    tied = Decoder(tied=True)
    assert shard_units(tied) == list(tied.blocks)
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Linear(2, 2))
    assert shard_units(flat) == [flat[0], flat[2], flat[3]]  # a stack of leaves: the top-level children
    nested = nn.Sequential(nn.Sequential(flat), nn.Linear(2, 2))
    assert shard_units(nested) == [nested[0], nested[1]]  # the Linears inside are not units


def test_config_file_field_and_its_refusals() -> None:
    assert parse_config("memdoctor_config: 1\nfull_offload: true\n").full_offload is True
    assert parse_config("memdoctor_config: 1\n").full_offload is False
    with pytest.raises(ConfigError, match="full_offload must be true or false"):
        parse_config("memdoctor_config: 1\nfull_offload: yes please\n")
    with pytest.raises(ConfigError, match="already offloads the optimizer state"):
        parse_config("memdoctor_config: 1\nfull_offload: true\noptimizer: offload\n")
    with pytest.raises(ConfigError, match="already offloads every parameter"):
        parse_config("memdoctor_config: 1\nfull_offload: true\noffload_parameters: [emb]\n")


# ----------------------------------------------------------------------------------------- whole scripts


def _losses(path: Path) -> list[float]:
    return list(json.loads(path.read_text())["losses"])


@pytest.mark.parametrize("more", [{}, {"accumulation_steps": 2}], ids=["alone", "micro-batched"])
def test_an_accelerate_loop_trains_the_same_under_full_offload(tmp_path: Path, more: dict[str, Any]) -> None:
    """accelerate builds the optimizer before ``prepare``; memdoctor shards at that build, and
    ``prepare`` leaves a DTensor model where it is: the losses of three steps are the unmodified run's,
    also with micro-batching inside the sharded model's forward."""
    run_script(ACCELERATE, ["--steps", "3", "--out", str(tmp_path / "base.json")])
    config = {"full_offload": True, **more}
    lines = run_script(ACCELERATE, ["--steps", "3", "--out", str(tmp_path / "run.json")], config)
    assert any(line.startswith("full_offload: BertForSequenceClassification sharded") for line in lines)
    base, run = _losses(tmp_path / "base.json"), _losses(tmp_path / "run.json")
    assert len(run) == 3 and run == pytest.approx(base, rel=1e-6)


def test_memdoctor_run_applies_full_offload_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "memdoctor.yaml"
    config.write_text("memdoctor_config: 1\nfull_offload: true\n")
    run_script(ACCELERATE, ["--steps", "2", "--out", str(tmp_path / "base.json")])
    done = memdoctor_cli(
        "run",
        "--config",
        str(config),
        str(ACCELERATE),
        "--",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "run.json"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "memdoctor: full_offload: BertForSequenceClassification sharded" in done.stderr
    assert _losses(tmp_path / "run.json") == pytest.approx(_losses(tmp_path / "base.json"), rel=1e-6)
