"""A causal language model fine-tuned the way Hugging Face's ``run_clm_no_trainer.py`` examples do it,
written for memdoctor's corpus: an ``accelerate.Accelerator`` with ``gradient_accumulation_steps``,
``accelerator.prepare`` of model, optimizer, DataLoader and scheduler, AdamW over weight-decay groups,
``get_scheduler("linear")``, ``with accelerator.accumulate(model)``, the model's own loss
(``outputs.loss``) and ``accelerator.backward``. A tiny GPT-2 built from a config (no download) over
random token blocks; a few steps.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler


def blocks(n: int, block_size: int, vocab: int) -> list[dict[str, list[int]]]:
    """Token blocks as ``group_texts`` leaves them: input_ids and labels the same list."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, block_size), generator=g).tolist()
    return [{"input_ids": row, "attention_mask": [1] * block_size, "labels": row} for row in ids]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--max_train_steps", type=int, default=4)
    args = p.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(config)
    n = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.max_train_steps
    train_dataloader = DataLoader(
        blocks(n, args.block_size, config.vocab_size),
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    no_decay = ["bias", "layer_norm.weight", "ln_"]
    groups = [
        {
            "params": [q for name, q in model.named_parameters() if not any(nd in name for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [q for name, q in model.named_parameters() if any(nd in name for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    lr_scheduler = get_scheduler(
        name="linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=args.max_train_steps
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    completed_steps = 0
    model.train()
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            print(f"step {completed_steps} loss {loss.item():.4f}")
        if completed_steps >= args.max_train_steps:
            break


if __name__ == "__main__":
    main()
