"""Fine-tune a BERT sequence classifier with a Hugging Face `accelerate` loop.

The loop is written by hand, as in examples/plain_loop.py, but the model, optimizer and DataLoader go
through `accelerator.prepare(...)` and the backward pass through `accelerator.backward(loss)`, so the same
script runs on CPU, one GPU or several, with or without mixed precision. memdoctor profiles it unmodified:

    memdoctor profile examples/accelerate_loop.py -- --mixed-precision bf16

The model is a tiny 2-layer BERT over synthetic token ids; it runs in seconds on a CPU.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification


def synthetic_data(n: int, seq_len: int, vocab_size: int, seed: int) -> TensorDataset:
    """Token ids with variable real lengths, padded with 0 and masked, plus binary labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (n, 1), generator=g)
    mask = (torch.arange(seq_len) < lengths).long()
    input_ids = torch.randint(1, vocab_size, (n, seq_len), generator=g) * mask
    labels = torch.randint(0, 2, (n,), generator=g)
    return TensorDataset(input_ids, mask, labels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum
    )
    set_seed(args.seed)

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=128,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = synthetic_data(
        args.steps * args.batch_size * args.grad_accum, args.seq_len, config.vocab_size, args.seed
    )
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
    )

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()

    step = 0
    for input_ids, attention_mask, labels in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            accelerator.backward(loss)
            optimizer.step()  # a no-op until the last micro-batch of an accumulation window
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            accelerator.print(f"step {step}/{args.steps}  loss {loss.item():.4f}")
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
