"""End to end on the four shapes of training code: ``memdoctor profile`` on each bundled example, for real.

Each example (a plain loop, the Hugging Face ``Trainer``, a Lightning ``Trainer``, an ``accelerate`` loop)
is copied into a temporary folder and profiled in-process through ``memdoctor.cli.main`` (the supervisor
in this process, the script in its supervised child) with a tiny model on CPU. The ledger is then
checked against the same model built independently here from the same config: module names, parameter
bytes (tied storages once), gradients, AdamW state, activations and the ``summary.json`` figures.

Each example is profiled once per test session (``profiled`` caches the runs) and every test reads the
run it needs. The last tests check that a script and a ``-m`` module run as ``python`` would run them,
by comparing what they see with what the same code sees under plain ``python``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from memdoctor import exitcodes
from memdoctor.cli import main
from memdoctor.trace import ModelInfo, StepRecord, Trace, load_trace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Tiny and fast; 6 steps so that memdoctor (1 warm-up + 2 steps) stops the script, not the script itself.
SMALL = ["--steps", "6", "--batch-size", "2", "--seq-len", "16"]
SEQ_LEN = 16
CHILD_ENV = {
    "CUDA_VISIBLE_DEVICES": "",  # CPU even on a GPU machine
    "HF_HUB_OFFLINE": "1",  # models come from configs; a download attempt fails loudly
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}
SUMMARY_KEYS = ("format_version", "device", "steps_profiled", "peak_memory_bytes", "categories", "layers")
CATEGORY_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "other")
LAYER_KEYS = (
    *("name", "param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes"),
    *("forward_ms", "backward_ms"),
)
# AdamW keeps exp_avg and exp_avg_sq (2 x the parameter) plus a scalar `step` tensor per parameter.
STEP_TENSOR_MAX_BYTES = 8
OPT_STATE_SLACK_BYTES = 4096


# ----------------------------------------------------------------------------------------- the models


def _bert(_: Path) -> nn.Module:
    """The BERT of examples/plain_loop.py (defaults) and examples/accelerate_loop.py."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=128,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def _gpt2(_: Path) -> nn.Module:
    """The GPT-2 of examples/hf_trainer.py (defaults, not --small): its lm_head is tied to wte."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=999, eos_token_id=999
    )
    return GPT2LMHeadModel(config)


def _lightning(script: Path) -> nn.Module:
    """The example's own LightningModule class, built with the example's defaults and --seq-len."""
    spec = importlib.util.spec_from_file_location("memdoctor_test_lightning_example", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TransformerClassifier(1000, SEQ_LEN, 64, 2, 2, n_classes=2, lr=1e-3)


@dataclass(frozen=True)
class Shape:
    script: str
    expected_names: tuple[str, ...]
    model_class: str
    build: Callable[[Path], nn.Module]


SHAPES = {
    "plain": Shape(
        "examples/plain_loop.py",
        ("bert.encoder.layer.0.attention", "bert.embeddings.word_embeddings", "classifier"),
        "BertForSequenceClassification",
        _bert,
    ),
    "hf_trainer": Shape(
        "examples/hf_trainer.py",
        ("transformer.h.0.attn", "transformer.h.1.mlp", "transformer.wte", "lm_head"),
        "GPT2LMHeadModel",
        _gpt2,
    ),
    "lightning": Shape(
        "examples/lightning_train.py",
        ("embed", "encoder.layers.0.self_attn", "encoder.layers.1.linear2", "head"),
        "TransformerClassifier",
        _lightning,
    ),
    "accelerate": Shape(
        "examples/accelerate_loop.py",
        ("bert.encoder.layer.1.attention.self.query", "bert.pooler", "classifier"),
        "BertForSequenceClassification",
        _bert,
    ),
}


# ----------------------------------------------------------------------------------------- running


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@dataclass
class Profiled:
    code: int
    out: Path
    cwd: Path
    scripts: Path
    scripts_before: set[str]
    trace: Trace
    summary: dict[str, Any]
    model: nn.Module  # the same model, built here independently

    @property
    def info(self) -> ModelInfo:
        assert len(self.trace.models) == 1, [m.cls for m in self.trace.models]
        return self.trace.models[0]

    def profiled_steps(self) -> list[StepRecord]:
        return [s for s in self.trace.steps if s.complete and not s.warmup]


def profile_in_process(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
    """``memdoctor.cli.main(argv)`` run from ``cwd``, its child with ``CHILD_ENV`` (and ``env``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        for key, value in {**CHILD_ENV, **(env or {})}.items():
            mp.setenv(key, value)
        return main(argv)


class Runs:
    """Each example profiled once, on first use."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[str, Profiled] = {}

    def __getitem__(self, name: str) -> Profiled:
        if name not in self.done:
            self.done[name] = self._run(SHAPES[name])
        return self.done[name]

    def _run(self, shape: Shape) -> Profiled:
        base = self.factory.mktemp(Path(shape.script).stem)
        scripts, cwd, out, tmp = base / "scripts", base / "cwd", base / "out", base / "tmp"
        for folder in (scripts, cwd, tmp):
            folder.mkdir()
        script = scripts / Path(shape.script).name
        shutil.copy2(REPO / shape.script, script)  # a copy: others may edit examples/ meanwhile
        before = tree(scripts)
        argv = ["profile", "--warmup", "1", "--steps", "2", "-o", str(out), str(script), "--", *SMALL]
        code = profile_in_process(argv, cwd, {"TMPDIR": str(tmp)})  # framework scratch dirs go to tmp/
        assert code == exitcodes.OK, f"memdoctor profile {shape.script} exited {code}"
        trace = load_trace(out / "trace.jsonl.gz")
        summary = json.loads((out / "summary.json").read_text())
        return Profiled(code, out, cwd, scripts, before, trace, summary, shape.build(script))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


# ------------------------------------------------------------------------------ independent figures


def storage_bytes(t: Any) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def unique_param_bytes(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Bytes of the model's parameter storages, each storage once (tied weights share one)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if p.requires_grad or not trainable_only:
            ptr, nbytes = storage_bytes(p)
            seen[ptr] = nbytes
    return sum(seen.values())


def own_param_bytes(model: nn.Module) -> dict[str, int]:
    """Per module (``named_modules`` order), bytes of the storages it owns directly, a shared one counted
    at the first module that holds it (the trace format's rule)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        out[name] = 0
        for p in module.parameters(recurse=False):
            ptr, nbytes = storage_bytes(p)
            if ptr not in seen:
                seen.add(ptr)
                out[name] += nbytes
    return out


def param_tensor_count(model: nn.Module) -> int:
    return len({storage_bytes(p)[0] for p in model.parameters() if p.requires_grad})


def column(step: StepRecord, name: str, model: int = 0) -> list[Any]:
    return step.modules[model][name]


def last_backward_sample(step: StepRecord) -> int:
    events = step.timeline["event"] or []
    return max(i for i, e in enumerate(events) if str(e).startswith("bwd"))


# ----------------------------------------------------------------------------------------- tests

ALL = list(SHAPES)


@pytest.mark.parametrize("name", ALL)
def test_profiles_the_example_unmodified(profiled: Runs, name: str) -> None:
    run = profiled[name]
    shape = SHAPES[name]
    trace = run.trace
    assert trace.header["device"]["kind"] == "cpu"
    assert trace.header["settings"]["warmup"] == 1 and trace.header["settings"]["steps"] == 2
    assert [m.cls for m in trace.models] == [shape.model_class]
    names = run.info.names
    assert names == [n for n, _ in run.model.named_modules()]
    missing = [n for n in shape.expected_names if n not in names]
    assert not missing, f"qualified names missing from the module table: {missing}"
    assert [(s.step, s.warmup, s.complete) for s in trace.steps] == [
        (0, True, True),
        (1, False, True),
        (2, False, True),
    ]
    assert trace.end is not None and trace.end["status"] == "completed"
    assert trace.end["steps_recorded"] == 3 and trace.end["memdoctor_exit_code"] == exitcodes.OK
    assert (run.out / "report.html").stat().st_size > 0
    assert tree(run.scripts) == run.scripts_before, "memdoctor wrote beside the script"
    assert not tree(run.cwd), f"memdoctor wrote into the working folder: {sorted(tree(run.cwd))}"


@pytest.mark.parametrize("name", ALL)
def test_parameter_bytes_count_shared_storages_once(profiled: Runs, name: str) -> None:
    run = profiled[name]
    info = run.info
    assert sum(info.param_bytes) == unique_param_bytes(run.model)
    assert sum(info.trainable_param_bytes) == unique_param_bytes(run.model, trainable_only=True)
    assert dict(zip(info.names, info.param_bytes, strict=True)) == own_param_bytes(run.model)
    if name == "hf_trainer":  # the tied lm_head: its storage is wte's, counted there only
        everything = sum(
            p.numel() * p.element_size() for _, p in run.model.named_parameters(remove_duplicate=False)
        )
        assert everything > sum(info.param_bytes)
        assert info.param_bytes[info.names.index("lm_head")] == 0


@pytest.mark.parametrize("name", ALL)
def test_gradients_and_adamw_state_map_to_their_modules(profiled: Runs, name: str) -> None:
    """Every script zeroes gradients after optimizer.step, so at the step all trainable params have one."""
    run = profiled[name]
    info = run.info
    trainable = info.trainable_param_bytes
    n_tensors = param_tensor_count(run.model)
    assert len(run.profiled_steps()) == 2
    for step in run.profiled_steps():
        grads, state = column(step, "grad_bytes"), column(step, "optimizer_state_bytes")
        assert grads == trainable, f"step {step.step}: per-module gradient bytes differ from the parameters"
        assert sum(grads) == unique_param_bytes(run.model, trainable_only=True)
        extra = sum(state) - 2 * sum(trainable)
        assert 0 <= extra <= min(OPT_STATE_SLACK_BYTES, STEP_TENSOR_MAX_BYTES * n_tensors), extra
        for i, (own_state, own_trainable) in enumerate(zip(state, trainable, strict=True)):
            assert 2 * own_trainable <= own_state <= 2 * own_trainable + 4 * STEP_TENSOR_MAX_BYTES, (
                f"step {step.step}: {info.names[i]!r} has {own_state} B of AdamW state for "
                f"{own_trainable} B of parameters"
            )


@pytest.mark.parametrize("name", ALL)
def test_activations_and_the_peak(profiled: Runs, name: str) -> None:
    run = profiled[name]
    info = run.info
    for step in run.profiled_steps():
        acts = column(step, "activation_bytes")
        assert acts[0] > 0, "the root module saved nothing for backward"
        calls = column(step, "calls")
        for i, parent in enumerate(info.parents):  # inclusive of submodules (containers never run)
            if parent >= 0 and calls[parent] and calls[i]:
                assert acts[parent] >= acts[i], (info.names[parent], info.names[i])
        cats = step.memory["categories_at_peak"]
        assert cats["activations"] > 0
        assert cats["parameters"] == unique_param_bytes(run.model)
        assert cats["other"] is None  # CPU: no allocator
        accounted = sum(cats[c] for c in ("parameters", "gradients", "optimizer_state", "activations"))
        assert step.memory["peak_source"] == "accounting"
        assert step.memory["peak_bytes"] == accounted == step.memory["accounted_bytes"]


@pytest.mark.parametrize("name", ALL)
def test_summary_json(profiled: Runs, name: str) -> None:
    run = profiled[name]
    summary = run.summary
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    assert not missing, missing
    assert summary["format_version"] == 1
    assert summary["device"]["kind"] == "cpu"
    assert {"name", "total_memory_bytes"} <= set(summary["device"])
    assert summary["steps_profiled"] == 2
    assert set(CATEGORY_KEYS) <= set(summary["categories"])
    peak = max(run.profiled_steps(), key=lambda s: s.memory["peak_bytes"])
    assert summary["peak_memory_bytes"] == peak.memory["peak_bytes"] > 0
    assert summary["categories"] == peak.memory["categories_at_peak"]
    layers = summary["layers"]
    assert len(layers) == len(run.info.names)
    for row in layers:
        assert set(LAYER_KEYS) <= set(row), sorted(set(LAYER_KEYS) - set(row))
    by_name = {row["name"]: row for row in layers}
    assert all(n in by_name for n in SHAPES[name].expected_names)
    assert sum(row["param_bytes"] for row in layers) == unique_param_bytes(run.model)
    assert sum(row["grad_bytes"] for row in layers) == unique_param_bytes(run.model, trainable_only=True)
    assert by_name[SHAPES[name].expected_names[0]]["forward_ms"] is not None


@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "hf_trainer",
        "lightning",
        "accelerate",
    ],
)
def test_one_forward_pass_per_step(profiled: Runs, name: str) -> None:
    """None of the examples accumulates gradients: one forward pass of the model per optimizer step."""
    assert [s.micro_batches for s in profiled[name].trace.steps] == [1, 1, 1]


@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "hf_trainer",
        "lightning",
        "accelerate",
    ],
)
def test_timeline_gradients_never_exceed_the_trainable_parameters(profiled: Runs, name: str) -> None:
    run = profiled[name]
    limit = unique_param_bytes(run.model, trainable_only=True)
    for step in run.trace.steps:
        worst = max(step.timeline["gradients"] or [0])
        assert worst <= limit, f"step {step.step}: {worst} B of gradients for {limit} B of parameters"
        assert step.memory["categories_at_peak"]["gradients"] <= limit


@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "hf_trainer",
        "lightning",
        "accelerate",
    ],
)
def test_timeline_gradients_at_the_end_of_backward(profiled: Runs, name: str) -> None:
    """When backward ends every gradient the optimizer will use exists: the timeline must show them all
    (at the optimizer's pre-hook sample where it follows backward, else at the last backward sample)."""
    run = profiled[name]
    for step in run.profiled_steps():
        events = step.timeline["event"] or []
        last = last_backward_sample(step)
        after = [i for i, e in enumerate(events) if e == "opt_pre" and i > last]
        at_end = step.timeline["gradients"][after[0] if after else last]
        assert at_end == sum(column(step, "grad_bytes")), f"step {step.step}"


# ----------------------------------------------------------------------------------------- as python runs it

FACTS_SCRIPT = """\
import json
import os
import sys

import torch

facts = {
    "name": __name__,
    "argv": list(sys.argv),
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "file": __file__,
    "spec": getattr(__spec__, "name", None),
    "main_is_this_module": sys.modules["__main__"].__dict__ is globals(),
}
with open(sys.argv[1], "w") as fh:
    json.dump(facts, fh)

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@dataclass
class AsPython:
    plain: dict[str, Any]  # what the code saw under plain python
    profiled: dict[str, Any]  # ... and under memdoctor profile
    code: int
    cwd: Path
    folder: Path  # the script's (or package's) folder
    added_by_python: set[str]
    added_by_memdoctor: set[str]


def _run_both(
    base: Path, cwd: Path, folder: Path, python_target: list[str], md_target: list[str]
) -> AsPython:
    """Run the facts script under python, then under memdoctor; what each wrote into ``folder``."""
    args = ["--flag", "value with spaces"]
    before = tree(folder)
    env = {**os.environ, **CHILD_ENV}
    proc = subprocess.run(
        [sys.executable, *python_target, str(base / "plain.json"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    after_python = tree(folder)
    argv = ["profile", "--warmup", "1", "--steps", "2", "-o", str(base / "out"), *md_target]
    code = profile_in_process([*argv, "--", str(base / "profiled.json"), *args], cwd)
    plain = json.loads((base / "plain.json").read_text())
    profiled = json.loads((base / "profiled.json").read_text())
    profiled["argv"] = [
        str(base / "plain.json") if a == str(base / "profiled.json") else a for a in profiled["argv"]
    ]
    return AsPython(plain, profiled, code, cwd, folder, after_python - before, tree(folder) - after_python)


@pytest.fixture(scope="module")
def as_script(tmp_path_factory: pytest.TempPathFactory) -> AsPython:
    base = tmp_path_factory.mktemp("as_script")
    scripts, cwd = base / "scripts", base / "cwd"
    scripts.mkdir()
    cwd.mkdir()
    (scripts / "train.py").write_text(FACTS_SCRIPT)
    target = [os.path.join("..", "scripts", "train.py")]  # relative, as a user would type it
    return _run_both(base, cwd, scripts, target, target)


@pytest.fixture(scope="module")
def as_module(tmp_path_factory: pytest.TempPathFactory) -> AsPython:
    base = tmp_path_factory.mktemp("as_module")
    project = base / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "train.py").write_text(FACTS_SCRIPT)
    return _run_both(base, project, project, ["-m", "pkg.train"], ["-m", "pkg.train"])


def test_script_runs_as_python_runs_it(as_script: AsPython) -> None:
    facts = as_script.profiled
    assert as_script.code == exitcodes.OK
    assert facts["name"] == "__main__" and facts["main_is_this_module"]
    script = os.path.join("..", "scripts", "train.py")
    assert facts["argv"] == [script, as_script.plain["argv"][1], "--flag", "value with spaces"]
    assert facts["path0"] == os.path.realpath(as_script.folder)
    assert facts["cwd"] == str(as_script.cwd)
    for key in ("name", "argv", "path0", "cwd", "spec", "main_is_this_module"):
        assert facts[key] == as_script.plain[key], key
    assert not as_script.added_by_memdoctor, (
        f"memdoctor wrote beside the script: {as_script.added_by_memdoctor}"
    )
    assert not tree(as_script.cwd)


def test_script_file_is_absolute_as_under_python(as_script: AsPython) -> None:
    assert as_script.profiled["file"] == as_script.plain["file"]


def test_module_runs_as_python_dash_m_runs_it(as_module: AsPython) -> None:
    facts = as_module.profiled
    assert as_module.code == exitcodes.OK
    assert facts["name"] == "__main__" and facts["main_is_this_module"]
    assert facts["spec"] == "pkg.train"
    train = str(as_module.folder / "pkg" / "train.py")
    assert facts["argv"] == [train, as_module.plain["argv"][1], "--flag", "value with spaces"]
    assert facts["path0"] == str(as_module.cwd) == facts["cwd"]
    assert facts["file"] == train
    assert facts == as_module.plain
    assert not as_module.added_by_memdoctor, (
        f"memdoctor wrote into the project: {as_module.added_by_memdoctor}"
    )
    assert all(p.startswith(os.path.join("pkg", "__pycache__")) for p in as_module.added_by_python)
