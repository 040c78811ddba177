"""Offload (memdoctor/levers/offload.py): optimizer state and chosen modules' parameters on the host.

On a CPU-only machine the host and the execution device are the same device, so these tests check the
mechanics that do not depend on a GPU: the swap to the host buffers and back (separate storages, the
Parameter objects kept), the optimizer's state created on the host, the parametrization copying the
host parameter in, ties kept, the undo, and that training is the same as without offload (to 1e-6
relative after 1 and 3 AdamW steps). Pinned memory and the asynchronous copies need CUDA: on a GPU
machine, ``MEMDOCTOR_TEST_DEVICE=cuda python -m pytest tests/test_offload.py`` runs the same tests with
the model on the GPU and the host the CPU (the tests of the CPU-only scripts stay on the CPU).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import memdoctor
from memdoctor.config.file import config_from_mapping
from memdoctor.errors import ConfigError
from memdoctor.levers.offload import OptimizerOffload, ParameterOffload

sys.path.insert(0, str(Path(__file__).parent))
from test_run import PLAIN, memdoctor_cli, run_script

RTOL = 1e-6
# where the model runs; "cuda" means cuda:0, as tensors report it (torch.device("cuda") != cuda:0)
DEVICE = torch.device(os.environ.get("MEMDOCTOR_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and DEVICE.index is None:
    DEVICE = torch.device("cuda", 0)
# The loss over 20 steps of tests/scripts/run_plain.py with optimizer offload and the embedding's
# parameters offloaded, against the unmodified run (docs/config.md, "Offload"): the same fp32 update,
# computed by torch's fused CPU AdamW instead of its per-tensor loop, so equal to float rounding;
# measured largest difference 6e-8 (loss ~0.7).
OFFLOAD_LOSS_TOLERANCE = 1e-5


class Tiny(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _build(tied: bool = False, **opt_kwargs: Any) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(tied).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kwargs)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, clip: float | None = None) -> None:
    """A plain loop with an LR scheduler (built after the offload, as in a script) and grad clipping."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 20, (4, 6), generator=g).to(DEVICE)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if (a[k] - b[k]).norm() > RTOL * a[k].norm()]


Offload = Callable[[nn.Module, torch.optim.Optimizer], Callable[[], None]]


def _opt_offload(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    return OptimizerOffload(opt, host="cpu").install()


def _param_offload(*names: str) -> Offload:
    def offload(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        return ParameterOffload(model, names, device=DEVICE, host="cpu", optimizers=[opt]).install()

    return offload


def _both(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    params = ParameterOffload(model, ["embed", "mid"], device=DEVICE, host="cpu", optimizers=[opt])
    undo_params = params.install()
    undo_opt = OptimizerOffload(opt, host="cpu", resident=params.params.values()).install()

    def undo() -> None:
        undo_opt()
        undo_params()

    return undo


CASES = {
    "optimizer": _opt_offload,
    "embedding": _param_offload("embed"),
    "linear": _param_offload("mid"),
    "both": _both,
}


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_offloaded_training_equals_the_plain_run(case: str, steps: int, clip: float | None) -> None:
    model, opt = _build()
    _train(model, opt, steps, clip=clip)
    base = _values(model)
    model, opt = _build()
    undo = CASES[case](model, opt)
    try:
        _train(model, opt, steps, clip=clip)
        assert _close(base, _values(model)) == []
    finally:
        undo()
    assert _close(base, _values(model)) == []  # and after the undo


def test_optimizer_state_lives_in_host_buffers_and_the_step_swaps_back() -> None:
    model, opt = _build()
    params = list(model.parameters())
    storages = [p.data_ptr() for p in params]
    seen: list[list[int]] = []
    offload = OptimizerOffload(opt, host="cpu")
    undo = offload.install()
    # the optimizer's own step (inside the wrapper) runs its pre-hooks: what does it see?
    handle = opt.register_step_pre_hook(lambda o, a, k: seen.append([p.data_ptr() for p in params]))
    try:
        _train(model, opt, 2)
        on_host = [opt.state[p]["exp_avg"] for p in params]
    finally:
        handle.remove()
        undo()
    masters = [offload._buffers[id(p)][0].data_ptr() for p in params]
    assert seen == [masters, masters]  # the optimizer's own step ran on the host master copies
    assert all(m != s for m, s in zip(masters, storages, strict=True))  # separate storages
    assert [p.data_ptr() for p in params] == storages  # the script's parameters swapped back
    assert all(t.device.type == "cpu" and t.data_ptr() not in storages for t in on_host)
    assert all(
        t.is_pinned() == torch.cuda.is_available() for t in offload._buffers[id(params[0])] if t is not None
    )
    assert all(opt.state[p]["exp_avg"].device == p.device for p in params)  # the undo put it back beside
    assert "step" not in vars(opt)


def test_state_a_checkpoint_loaded_moves_to_the_host_and_state_dict_round_trips() -> None:
    model, opt = _build()
    _train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live state tensors
    model2, opt2 = _build()
    model2.load_state_dict(model.state_dict())
    undo = OptimizerOffload(opt2, host="cpu").install()
    try:
        opt2.load_state_dict(saved)  # the script resumes before its first step
        assert opt2.state[model2.mid.weight]["exp_avg"].device == DEVICE  # load_state_dict put it there
        _train(model2, opt2, 1)
        assert opt2.state[model2.mid.weight]["exp_avg"].device.type == "cpu"  # the first step moved it
        _train(model, opt, 1)
        assert _close(_values(model), _values(model2)) == []
        again = opt2.state_dict()
        assert again["state"].keys() == saved["state"].keys()
    finally:
        undo()


def test_a_closure_runs_once_before_the_host_step() -> None:
    model, opt = _build()
    calls = []
    undo = OptimizerOffload(opt, host="cpu").install()
    try:

        def closure() -> torch.Tensor:
            calls.append(1)
            opt.zero_grad()
            loss = model(torch.arange(6, device=DEVICE).view(1, 6)).sum()
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor) and calls == [1]
        assert opt.state[model.embed.weight]["exp_avg"].abs().sum() > 0
    finally:
        undo()


def test_lbfgs_is_refused_by_name() -> None:
    model = Tiny().to(DEVICE)
    with pytest.raises(ValueError, match="LBFGS evaluates its closure several times"):
        OptimizerOffload(torch.optim.LBFGS(model.parameters()), host="cpu").install()


def test_capturable_groups_step_on_the_host_without_it_and_get_it_back() -> None:
    _, opt = _build(capturable=False)
    opt.param_groups[0]["capturable"] = True  # as a CUDA script would build it
    offload = OptimizerOffload(opt, host="cpu")
    undo = offload.install()
    assert opt.param_groups[0]["capturable"] is False
    assert offload.notes[0] == "capturable=False on the host"
    undo()
    assert opt.param_groups[0]["capturable"] is True


def test_the_host_step_uses_the_fused_cpu_kernel_where_the_script_left_the_choice_to_torch() -> None:
    model, opt = _build()
    offload = OptimizerOffload(opt, host="cpu")
    undo = offload.install()
    try:
        assert opt.param_groups[0]["fused"] is True
        assert "stepped with torch's fused CPU kernel (fused=True)" in offload.notes
        saved = copy.deepcopy(opt.state_dict())
        saved["param_groups"][0]["fused"] = None  # a checkpoint's groups replace the group dicts
        saved["param_groups"][0]["capturable"] = True
        opt.load_state_dict(saved)
        _train(model, opt, 1)  # the step sets the flags again on the new group
        assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["capturable"] is False
    finally:
        undo()
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["capturable"] is True
    _, explicit = _build(foreach=True)
    offload = OptimizerOffload(explicit, host="cpu")
    undo = offload.install()
    assert explicit.param_groups[0]["fused"] is None and offload.notes == []  # the script's choice kept
    undo()


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_optimizers_step_on_the_host(flag: str) -> None:
    model, opt = _build(**{flag: True})
    _train(model, opt, 2)
    base = _values(model)
    model, opt = _build(**{flag: True})
    undo = _both(model, opt)
    try:
        _train(model, opt, 2)
    finally:
        undo()
    assert _close(base, _values(model)) == []


def test_parameter_offload_keeps_the_parameter_objects_on_the_host() -> None:
    model, opt = _build()
    weight, bias = model.mid.weight, model.mid.bias
    offload = ParameterOffload(model, ["mid"], device=DEVICE, host="cpu", optimizers=[opt])
    undo = offload.install()
    try:
        assert parametrize.is_parametrized(model.mid, "weight")
        assert model.mid.parametrizations.weight.original is weight  # the optimizer's object
        assert model.mid.parametrizations.bias.original is bias
        assert weight.is_pinned() == torch.cuda.is_available()  # pinned where CUDA exists
        assert sorted(model.state_dict()) == ["embed.weight", "head.weight", "mid.bias", "mid.weight"]
        _train(model, opt, 1)
        assert weight.grad is None and opt.state[weight]["exp_avg"].device.type == "cpu"
        model.to(torch.float64)  # a later move/cast: the anchors follow, the host parameters stay
        assert weight.dtype == torch.float32 and weight.device.type == "cpu"
        assert model.mid.weight.dtype == torch.float64 and model.mid.weight.device == DEVICE
        model.to(torch.float32)
        model.load_state_dict(model.state_dict())  # the saved keys load back
    finally:
        undo()
    assert not parametrize.is_parametrized(model.mid)
    assert type(model.mid) is nn.Linear and model.mid.weight is weight and model.mid.bias is bias
    assert sorted(model.state_dict()) == ["embed.weight", "head.weight", "mid.bias", "mid.weight"]


def test_tied_weights_stay_tied() -> None:
    model, opt = _build(tied=True)
    _train(model, opt, 3)
    base = _values(model)
    model, opt = _build(tied=True)
    offload = ParameterOffload(model, ["embed"], device=DEVICE, host="cpu", optimizers=[opt])
    assert offload.tied() == ["head.weight"]
    undo = offload.install()
    try:
        assert parametrize.is_parametrized(model.head, "weight")  # the other holder too
        assert model.head.parametrizations.weight.original is model.embed.parametrizations.weight.original
        _train(model, opt, 3)
        assert _close(base, _values(model)) == []
    finally:
        undo()
    assert model.head.weight is model.embed.weight
    assert _close(base, _values(model)) == []


def test_parameter_offload_refusals_are_named() -> None:
    model, _ = _build()
    with pytest.raises(ValueError, match="'mid' holds no parameters"):
        ParameterOffload(nn.ModuleDict({"mid": nn.ReLU()}), ["mid"]).install()
    parametrize.register_parametrization(model.mid, "weight", nn.Identity())
    try:
        taken = r"mid\.parametrizations\.weight\.original already has a parametrization"
        with pytest.raises(ValueError, match=taken):
            ParameterOffload(model, ["mid"]).install()
    finally:
        parametrize.remove_parametrizations(model.mid, "weight")


# ----------------------------------------------------------------------------- memdoctor.apply / run


def test_memdoctor_apply_offloads_and_remove_restores() -> None:
    model, opt = _build()
    _train(model, opt, 3)
    base = _values(model)
    model, opt = _build()
    cfg = config_from_mapping(
        {"memdoctor_config": 1, "optimizer": "offload", "offload_parameters": ["embed"]}, "test"
    )
    applied = memdoctor.apply(cfg, model, opt)
    assert parametrize.is_parametrized(model.embed)
    _train(model, opt, 3)
    applied.remove()
    assert not parametrize.is_parametrized(model.embed) and "step" not in vars(opt)
    assert _close(base, _values(model)) == []
    with pytest.raises(ConfigError, match=r"optimizer: offload: memdoctor\.apply was given no optimizer"):
        memdoctor.apply(cfg, model)


def _losses(path: Path) -> list[float]:
    data: list[float] = json.loads(path.read_text())["losses"]
    return data


OFFLOAD = {"optimizer": "offload", "offload_parameters": ["embed"]}


def test_memdoctor_run_offloads_and_keeps_the_loss(tmp_path: Path) -> None:
    run_script(PLAIN, ["--clip", "1.0", "--out", str(tmp_path / "base.json")])
    lines = run_script(PLAIN, ["--clip", "1.0", "--out", str(tmp_path / "run.json")], OFFLOAD)
    assert lines[0].startswith("offload: the parameters of 1 module(s) of TinyClassifier on the host")
    assert lines[1].startswith("offload: AdamW's state on the host")
    base, run = _losses(tmp_path / "base.json"), _losses(tmp_path / "run.json")
    assert len(run) == len(base) == 20
    assert max(abs(a - b) for a, b in zip(base, run, strict=True)) <= OFFLOAD_LOSS_TOLERANCE


def test_memdoctor_run_offload_with_a_closure_and_fp16(tmp_path: Path) -> None:
    """Lightning's shape (``step(closure)``) under the fp16 GradScaler, which wraps the offloaded step."""
    run_script(PLAIN, ["--steps", "5", "--out", str(tmp_path / "base.json")])
    config = {**OFFLOAD, "precision": "fp16"}
    run_script(PLAIN, ["--steps", "5", "--closure", "--out", str(tmp_path / "run.json")], config)
    base, run = _losses(tmp_path / "base.json"), _losses(tmp_path / "run.json")
    assert max(abs(a - b) for a, b in zip(base, run, strict=True)) < 0.02  # test_run's fp16 tolerance


@pytest.mark.slow  # a child process
def test_memdoctor_run_command_line_prints_the_applied_lines(tmp_path: Path) -> None:
    cfg = tmp_path / "memdoctor.yaml"
    cfg.write_text("memdoctor_config: 1\noptimizer: offload\noffload_parameters: [embed]\n")
    proc = memdoctor_cli("run", "--config", str(cfg), str(PLAIN), "--", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert "memdoctor: offload: AdamW's state on the host" in proc.stderr
    assert "memdoctor: offload: the parameters of 1 module(s) of TinyClassifier on the host" in proc.stderr


def test_memdoctor_run_names_an_lbfgs_refusal(tmp_path: Path) -> None:
    script = tmp_path / "lbfgs.py"
    script.write_text(
        "import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.LBFGS(m.parameters())\n"
        "opt.step(lambda: m(torch.ones(1, 2)).sum())\n"
    )
    with pytest.raises(ConfigError, match="optimizer: offload: LBFGS evaluates its closure"):
        run_script(script, [], {"optimizer": "offload"})


FRAMEWORKS = Path(__file__).parent / "scripts"


@pytest.mark.parametrize(
    ("script", "module", "model_class"),
    [
        ("fw_hf_trainer.py", "bert.embeddings.word_embeddings", "BertForSequenceClassification"),
        ("fw_lightning.py", "layer", "Tiny"),
    ],
)
def test_trainer_and_lightning_build_their_optimizer_through_torch_so_offload_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, module: str, model_class: str
) -> None:
    """The HF Trainer and Lightning build the optimizer with torch.optim (SGD here) inside them: the same
    generic path finds it and offloads; the weights after training equal the unmodified run's."""
    monkeypatch.chdir(tmp_path)  # Lightning may write beside the working directory
    run_script(FRAMEWORKS / script, [str(tmp_path / "base.json")])
    config = {"optimizer": "offload", "offload_parameters": [module]}
    lines = run_script(FRAMEWORKS / script, [str(tmp_path / "run.json")], config)
    assert lines[0].startswith(
        f"offload: the parameters of 1 module(s) of {model_class} on the host ({module};"
    )
    assert lines[1].startswith("offload: SGD's state on the host")
    base = json.loads((tmp_path / "base.json").read_text())
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["optimizer_steps"] == base["optimizer_steps"] > 0
    diff = (torch.tensor(run["weights"]) - torch.tensor(base["weights"])).norm()
    assert diff <= RTOL * torch.tensor(base["weights"]).norm()


def test_an_optimizer_built_after_the_model_was_found_is_named(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(
        "import torch\nm = torch.nn.Linear(2, 2)\nfirst = torch.optim.AdamW(m.parameters())\n"
        "second = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for opt in (first, second):\n    m(torch.ones(1, 2)).sum().backward()\n    opt.step()\n"
    )
    with pytest.raises(ConfigError, match="optimizer: offload: SGD, built after the model's first optimizer"):
        run_script(script, [], {"optimizer": "offload"})
