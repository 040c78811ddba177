"""An ``accelerate`` loop over a tiny HF BERT (dropout off, so runs compare exactly), for ``memdoctor run``
tests. It knows nothing of memdoctor; what it did goes to --out and its first gradients to --grads."""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out")
    p.add_argument("--grads")
    args = p.parse_args()
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    n, seq = args.steps * args.batch_size, 32
    lengths = torch.randint(4, seq - 8, (n, 1), generator=g)
    mask = (torch.arange(seq) < lengths).long()
    ids = torch.randint(1, 100, (n, seq), generator=g) * mask
    labels = torch.randint(0, 2, (n,), generator=g)
    loader = DataLoader(TensorDataset(ids, mask, labels), batch_size=args.batch_size)
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, (input_ids, attention_mask, y) in enumerate(loader):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=y).loss
        accelerator.backward(loss)
        if step == 0 and args.grads:
            torch.save({k: q.grad.clone() for k, q in model.named_parameters()}, args.grads)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"losses": losses, "steps": len(losses)}, fh)


if __name__ == "__main__":
    main()
