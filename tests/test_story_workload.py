"""The BERT-base workload's hand-tuning levers (``benchmarks/workloads/bert_story.py``), which
``benchmarks/story_scenario.py`` compares memdoctor's plan against: each must keep the training faithful,
or the comparison is unfair."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from transformers import BertConfig, BertForSequenceClassification

WORKLOAD = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads" / "bert_story.py"


def _workload() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bert_story", WORKLOAD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(ws: ModuleType) -> dict[str, torch.Tensor]:
    data = ws.PaddedClassification(4, 40, 100, seed=1)
    return {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}


def test_trim_padding_and_micro_batches() -> None:
    ws = _workload()
    batch = _batch(ws)
    trimmed = ws.trim_padding(batch)
    longest = int(batch["attention_mask"].sum(1).max())
    assert trimmed["input_ids"].shape[1] == min(40, -(-longest // 8) * 8) >= longest
    assert torch.equal(trimmed["labels"], batch["labels"])
    parts = ws.micro_batches(batch, 2)
    assert [len(p["labels"]) for p in parts] == [2, 2]
    assert ws.micro_batches(batch, None) == [batch]


def test_checkpoint_and_accumulation_keep_the_gradients() -> None:
    ws = _workload()
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    plain = BertForSequenceClassification(cfg)
    tuned = BertForSequenceClassification(cfg)
    tuned.load_state_dict(plain.state_dict())
    ws.checkpoint_layers(tuned, 2)
    assert isinstance(tuned.bert.encoder.layer[0], ws.Checkpointed)
    assert not isinstance(tuned.bert.encoder.layer[1], ws.Checkpointed)
    batch = _batch(ws)
    plain(**batch).loss.backward()
    parts = ws.micro_batches(batch, 2)
    for part in parts:
        (tuned(**part).loss / len(parts)).backward()
    grads = dict(plain.named_parameters())
    for name, p in tuned.named_parameters():
        ref = grads[name.replace(".inner.", ".")].grad
        assert p.grad is not None and ref is not None
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6)
