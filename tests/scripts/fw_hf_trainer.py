"""A tiny BERT fine-tuned with the HF Trainer; dumps what the Trainer actually used to a JSON file.

Used by tests/test_runtime_frameworks.py: run as-is and under memdoctor's framework patches.
``python fw_hf_trainer.py OUT.json [--batch 8] [--gas 1] [--layers 3] [--fp16] [--gc] [--workers 0]``
"""

import argparse
import json
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--gas", type=int, default=1)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--samples", type=int, default=24)
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--gc", action="store_true")
opts = parser.parse_args()

torch.manual_seed(0)
config = BertConfig(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=opts.layers,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,  # no dropout: a split batch draws no different masks
    attention_probs_dropout_prob=0.0,
)
model = BertForSequenceClassification(config)
data = [
    {
        "input_ids": torch.randint(0, 64, (8,)),
        "attention_mask": torch.ones(8, dtype=torch.long),
        "labels": i % 2,
    }
    for i in range(opts.samples)
]
seen: list[int] = []
model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["input_ids"].shape[0])), with_kwargs=True)

with tempfile.TemporaryDirectory() as tmp:
    args = TrainingArguments(
        output_dir=tmp,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.gas,
        num_train_epochs=1,
        learning_rate=0.5,
        use_cpu=True,
        fp16=opts.fp16,
        gradient_checkpointing=opts.gc,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    # SGD: the weights after training equal exactly when the gradients do (Adam would hide a scale)
    sgd = (torch.optim.SGD, {})
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=sgd)
    trainer.train()
    flags = [bool(getattr(m, "gradient_checkpointing", False)) for m in model.bert.encoder.layer]
    result = {
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "bf16": trainer.args.bf16,
        "fp16": trainer.args.fp16,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "gradient_checkpointing_kwargs": trainer.args.gradient_checkpointing_kwargs,
        "layer_checkpointing": flags,
        "dataloader_num_workers": trainer.args.dataloader_num_workers,
        "dataloader_pin_memory": trainer.args.dataloader_pin_memory,
        "optimizer_steps": trainer.state.global_step,
        "last_lr": trainer.lr_scheduler.get_last_lr()[0],
        "forward_batch_sizes": seen,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }
with open(opts.out, "w") as f:
    json.dump(result, f)
