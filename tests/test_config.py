"""memdoctor.yaml: the loader's refusals, memdoctor.apply's faithfulness on CPU, the exports."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import memdoctor
from memdoctor.config import (
    DataLoaderSettings,
    GradScalerSettings,
    PlanConfig,
    check_modules,
    dump_config,
    from_plan,
    load_config,
    parse_config,
)
from memdoctor.config.export import (
    accelerate_kwargs,
    hf_training_arguments,
    lightning_trainer_kwargs,
    not_expressed,
    plain_loop_snippet,
)
from memdoctor.errors import ConfigError
from memdoctor.levers.apply import not_applicable, split_batch


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 8)) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], rel: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=rel, atol=rel * float(y.abs().max()) + 1e-12)


# ----------------------------------------------------------------------------------------- loader


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    cfg = PlanConfig(
        checkpoint=("blocks.0", "blocks.2"),
        precision="fp16",
        grad_scaler=GradScalerSettings(1024.0, 100),
        micro_batch=4,
        accumulation_steps=8,
        allocator="expandable_segments:True",
        data_loader=DataLoaderSettings(num_workers=2, pin_memory=True),
    )
    path = tmp_path / "memdoctor.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("memdoctor_config: 1\nfoo: 1\n", "unknown key 'foo'"),
        ("memdoctor_config: 2\n", "newer than this memdoctor reads"),
        ("checkpoint: []\n", r"memdoctor_config \(the version\) is missing"),
        ("memdoctor_config: 1\naccumulation_steps: '4'\n", "accumulation_steps must be a whole number"),
        ("memdoctor_config: 1\naccumulation_steps: true\n", "accumulation_steps must be a whole number"),
        ("memdoctor_config: 1\nprecision: fp8\n", "precision must be one of"),
        ("memdoctor_config: 1\ncheckpoint: blocks.0\n", "checkpoint must be a list"),
        ("memdoctor_config: 1\ngrad_scaler: {init_scale: 2.0}\n", "for precision fp16 only"),
        ("memdoctor_config: 1\ndata_loader: {workers: 2}\n", "data_loader: unknown key 'workers'"),
        ("!!python/object/apply:os.system ['echo pwned']\n", "YAML tags are not allowed"),
        ("memdoctor_config: !!int 1\n", "YAML tags are not allowed"),
        ("a: &x [1]\nb: *x\n", "anchors and aliases"),
        ("- 1\n- 2\n", "a mapping"),
        ("memdoctor_config: [1\n", "not valid YAML"),
        ("memdoctor_config: 1\nparallel: ddp\n", "needs gpus of 2 or more"),
        ("memdoctor_config: 1\ngpus: 2\n", "gpus 2 needs parallel"),
        ("memdoctor_config: 1\ngpus: 2\nparallel: zero3\n", "parallel must be one of"),
        ("memdoctor_config: 1\ngpus: 2\nparallel: ddp\nshard_modules: [h.0]\n", "for parallel fsdp2"),
        ("memdoctor_config: 1\ngpus: 2\nparallel: ddp\nfull_offload: true\n", "needs parallel fsdp2"),
    ],
)
def test_bad_configs_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text)
    assert "\n" not in str(info.value)


def test_parallel_fields_round_trip() -> None:
    config = PlanConfig(gpus=4, parallel="fsdp2", shard_modules=("h.0", "h.1"), full_offload=True)
    again = parse_config(dump_config(config))
    assert (again.gpus, again.parallel, again.shard_modules, again.full_offload) == (
        4,
        "fsdp2",
        ("h.0", "h.1"),
        True,
    )
    assert parse_config("memdoctor_config: 1\n").parallel is None


def test_a_tag_never_constructs_an_object(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"!!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]\n"
    with pytest.raises(ConfigError):
        parse_config(text)
    assert not marker.exists()


def test_a_missing_file_and_a_binary_file_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "b.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(tmp_path / "b.yaml")


def test_a_module_the_model_lacks_is_named() -> None:
    cfg = PlanConfig(checkpoint=("encoder.layer.3",), provenance=from_plan({}).provenance)
    with pytest.raises(ConfigError, match=r"'encoder\.layer\.3'"):
        check_modules(cfg, ["", "blocks.0"])
    with pytest.raises(ConfigError, match="lacks"):
        memdoctor.apply(cfg, Tiny())


def test_config_error_exits_2() -> None:
    assert ConfigError("x").exit_code == 2


def test_from_plan_carries_the_plan_and_its_provenance() -> None:
    plan = {
        "config": {
            "checkpoint": ["blocks.1"],
            "accumulation_steps": 4,
            "precision": "fp16",
            "optimizer": "as-is",
        },
        "budget_bytes": 8 << 30,
        "fits": True,
        "predicted_peak_bytes": 7 << 30,
        "predicted_step_time_ratio": 1.25,
    }
    cfg = from_plan(plan, trace_path="t.jsonl.gz", batch_size=32)
    assert cfg.checkpoint == ("blocks.1",)
    assert (cfg.micro_batch, cfg.accumulation_steps) == (8, 4)
    assert cfg.grad_scaler == GradScalerSettings()
    assert cfg.provenance.budget_bytes == 8 << 30 and cfg.provenance.fits is True
    assert parse_config(dump_config(cfg)) == cfg
    assert from_plan(plan, batch_size=30).micro_batch is None  # 30 / 4 is not whole: not guessed


def test_from_plan_carries_the_planner_levers_and_its_grad_scaler() -> None:
    plan = {
        "config": {
            "precision": "fp16",
            "padding": "longest",
            "pad_to_multiple_of": 8,
            "offload_parameters": ["embed"],
            "attention": "sdpa",
            "allocator": "expandable",
        },
        "grad_scaler": {"init_scale": 4096.0, "growth_interval": 500, "basis": "measured"},
    }
    cfg = from_plan(plan)
    assert (cfg.padding, cfg.pad_to_multiple_of) == ("trim", 8)
    assert cfg.offload_parameters == ("embed",)
    assert (cfg.attention, cfg.allocator) == ("sdpa", "expandable_segments:True")
    assert cfg.grad_scaler == GradScalerSettings(4096.0, 500)
    assert parse_config(dump_config(cfg)) == cfg
    truncated = from_plan({"config": {"padding": "p90", "pad_to_multiple_of": 8}})
    assert (truncated.padding, truncated.pad_to_multiple_of) == ("as-is", None), "never written: changes data"
    refused = not_applicable(cfg)
    assert any(n.startswith("padding: trim") for n in refused)
    assert not any("offload_parameters" in n for n in refused)  # memdoctor.apply offloads (runtime/offload)
    with pytest.raises(ConfigError, match="'embed'"):
        check_modules(cfg, ["other"])


# ----------------------------------------------------------------------------------------- apply


def _one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    torch.manual_seed(2)  # a second step: gradients after one optimizer step
    nn.functional.cross_entropy(model(x), y).backward()
    return _grads(model)


def test_checkpointing_keeps_gradients_and_is_reversible() -> None:
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    base = Tiny()
    chk = copy.deepcopy(base)
    expected = _one_step(base, x, y)
    applied = memdoctor.apply(PlanConfig(checkpoint=("blocks.0", "blocks.2")), chk)
    calls = []
    orig = torch.utils.checkpoint.checkpoint

    def spy(*a: object, **k: object) -> object:
        calls.append(k.get("use_reentrant"))
        return orig(*a, **k)  # type: ignore[arg-type]

    torch.utils.checkpoint.checkpoint = spy  # type: ignore[assignment]
    try:
        import memdoctor.levers.apply as ca

        saved, ca.torch_checkpoint = ca.torch_checkpoint, spy  # type: ignore[assignment]
        got = _one_step(chk, x, y)
    finally:
        torch.utils.checkpoint.checkpoint = orig
        ca.torch_checkpoint = saved
    assert calls == [False] * 4  # two modules x two forwards, non-reentrant
    _close(got, expected)
    applied.remove()
    assert all("forward" not in m.__dict__ for m in chk.modules())


def test_accumulation_gradients_equal_the_full_batch() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 8), torch.randint(0, 2, (10,))
    full, acc = Tiny().eval(), Tiny().eval()  # eval: dropout off, so the batch split is the only change
    nn.functional.cross_entropy(full(x), y).backward()
    applied = memdoctor.apply(PlanConfig(accumulation_steps=4), acc)  # 10 / 4: uneven parts
    parts = list(applied.micro_batches({"x": x, "y": y}))
    assert [len(p["x"]) for p, _ in parts] == [2, 3, 2, 3]
    for micro, weight in parts:
        applied.backward(nn.functional.cross_entropy(acc(micro["x"]), micro["y"]) * weight)
    _close(_grads(acc), _grads(full))


def test_split_batch_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ConfigError, match="share no batch size"):
        list(split_batch((torch.zeros(4), torch.zeros(3)), 2))
    with pytest.raises(ConfigError, match="no tensor"):
        list(split_batch(["a", "b"], 2))
    with pytest.raises(ConfigError, match="cannot be split into 4"):
        list(split_batch(torch.zeros(3), 4))


def test_autocast_and_scaler() -> None:
    model = Tiny()
    with memdoctor.apply(PlanConfig(precision="bf16"), model).autocast():
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16
    with memdoctor.apply(PlanConfig(), model).autocast():
        assert model(torch.randn(2, 8)).dtype == torch.float32
    cfg = parse_config("memdoctor_config: 1\nprecision: fp16\ngrad_scaler: {init_scale: 128}\n")
    applied = memdoctor.apply(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert applied.scaler is not None and applied.scaler.get_scale() == 128.0
    m, _, loader = applied
    assert m is model and loader is None


@pytest.mark.parametrize(
    ("cfg", "part"),
    [
        (PlanConfig(optimizer="8bit"), "optimizer: 8bit"),
        (PlanConfig(optimizer="offload"), "optimizer: offload"),
        (PlanConfig(padding="trim"), "padding: trim"),
        (PlanConfig(attention="sdpa"), "attention: sdpa"),
    ],
)
def test_parts_that_cannot_apply_are_named(cfg: PlanConfig, part: str) -> None:
    model = Tiny()
    with pytest.raises(ConfigError, match=part):
        memdoctor.apply(cfg, model)
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing half-applied


def test_data_loader_settings_on_a_built_loader_are_refused() -> None:
    cfg = PlanConfig(data_loader=DataLoaderSettings(num_workers=2))
    loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(ConfigError, match="data_loader"):
        memdoctor.apply(cfg, Tiny(), None, loader)


# ----------------------------------------------------------------------------------------- exports

PLAN = PlanConfig(checkpoint=("blocks.0",), precision="bf16", micro_batch=8, accumulation_steps=4)


def test_hf_training_arguments_are_accepted_by_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    kw = hf_training_arguments(PLAN)
    assert kw["gradient_accumulation_steps"] == 4 and kw["per_device_train_batch_size"] == 8
    assert kw["bf16"] is True and kw["gradient_checkpointing"] is True
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)
    assert args.gradient_accumulation_steps == 4
    assert any("every layer" in n for n in not_expressed(PLAN, "hf"))


def test_lightning_and_accelerate_kwargs() -> None:
    assert lightning_trainer_kwargs(PLAN) == {"accumulate_grad_batches": 4, "precision": "bf16-mixed"}
    assert accelerate_kwargs(PLAN) == {"mixed_precision": "bf16", "gradient_accumulation_steps": 4}
    notes = not_expressed(PLAN, "lightning")
    assert any(n.startswith("checkpoint:") for n in notes)
    assert any("batch_size=8" in n for n in notes)
    lightning = pytest.importorskip("lightning")
    trainer = lightning.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, **lightning_trainer_kwargs(PlanConfig())
    )
    assert trainer.accumulate_grad_batches == 1


def test_plain_loop_snippet_compiles_and_names_what_it_leaves_out() -> None:
    text = plain_loop_snippet(PlanConfig(checkpoint=("a",), precision="fp16", optimizer="8bit"))
    compile(text, "<snippet>", "exec")
    assert "memdoctor.apply(config, model, optimizer)" in text
    assert "GradScaler" in text and "optimizer: 8bit" in text


# ----------------------------------------------------------------------------------------- writing

DATA = Path(__file__).parent / "data"


def test_the_report_writes_the_plan_as_memdoctor_yaml(tmp_path: Path) -> None:
    from memdoctor.report import write_report
    from memdoctor.trace import load_trace

    trace = load_trace(DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz")
    paths = write_report(trace, tmp_path)
    assert paths["config"] == tmp_path / "memdoctor.yaml"
    cfg = load_config(paths["config"])
    model = trace.models[0]
    check_modules(cfg, model.names, model.cls)  # every chosen module is one the traced model has
    assert cfg.provenance.model_class == model.cls and cfg.provenance.module_count == len(model.names)
    assert cfg.provenance.budget_bytes == 8 << 30
    assert cfg.provenance.trace == "gpu-bert-base-b8-s128-8gib.jsonl.gz"  # no folders of the user's


def test_plan_command_writes_a_config_and_never_overwrites_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memdoctor.cli import main

    trace = str(DATA / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz")
    out = tmp_path / "plan"
    assert main(["plan", trace, "-o", str(out)]) == 0
    cfg = load_config(out / "memdoctor.yaml")
    assert (cfg.checkpoint or cfg.accumulation_steps > 1) and cfg.provenance.fits is True
    assert f"Wrote {out / 'memdoctor.yaml'}" in capsys.readouterr().out
    (out / "memdoctor.yaml").write_text("mine")
    assert main(["plan", trace, "-o", str(out)]) == 2
    assert (out / "memdoctor.yaml").read_text() == "mine"
    assert "--force" in capsys.readouterr().err
    assert main(["plan", trace, "-o", str(out), "--force", "--budget", "6GiB"]) == 0
    assert load_config(out / "memdoctor.yaml").provenance.budget_bytes == 6 << 30


def test_the_report_shows_the_config_and_says_when_there_is_none(tmp_path: Path) -> None:
    from memdoctor.report import write_report
    from memdoctor.trace import load_trace

    html = write_report(load_trace(DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz"), tmp_path)[
        "report"
    ].read_text()
    assert '<h2 id="config">Apply the plan</h2>' in html
    assert "memdoctor_config: 1" in html and "gradient_accumulation_steps" in html
    from memdoctor.report.render import environment
    from memdoctor.report.sections.config import report_section

    assert report_section(load_trace(DATA / "gpu-bert-base-b8-s128-8gib.jsonl.gz"), {"plan": None}) is None
    text = environment().get_template("sections/config.html.j2").render(ctx=None)
    assert "Not measured: no plan to apply" in text


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).train()


def test_checkpointing_an_hf_model_switches_its_kv_cache_off_and_back() -> None:
    """A recomputed attention block appends to the KV cache again (on the H200: 2 GiB of a 0.95B
    decoder's peak), so memdoctor turns `use_cache` off while checkpointing, as HF's own switch does."""
    ids = torch.randint(0, 64, (2, 12))
    model = _tiny_llama()
    assert model.config.use_cache is True
    applied = memdoctor.apply(PlanConfig(checkpoint=("model.layers.0", "model.layers.1")), model)
    try:
        assert model.config.use_cache is False
        out = model(input_ids=ids, labels=ids)
        assert out.past_key_values is None
        out.loss.backward()
    finally:
        applied.remove()
    assert model.config.use_cache is True
    # the same model without memdoctor builds a cache in training: the thing switched off
    assert model(input_ids=ids, labels=ids).past_key_values is not None
