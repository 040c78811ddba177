"""Fine-tune a BERT sequence classifier with a plain PyTorch training loop.

This is the most common shape of training code: build a model, a DataLoader and an optimizer, then loop
forward -> backward -> step. Nothing here knows about memdoctor; profile it unmodified with

    memdoctor profile examples/plain_loop.py -- --batch-size 8

The defaults build a tiny 2-layer BERT that runs in seconds on a CPU. The same script with BERT-base sizes
is the workload from memdoctor's story (a 12-layer, ~110M-parameter model on an 8 GB card):

    python examples/plain_loop.py --layers 12 --hidden 768 --heads 12 --intermediate 3072 \\
        --vocab 30522 --max-pos 512 --seq-len 512 --batch-size 32

The data is synthetic: random token ids with variable real lengths, padded with 0 to --seq-len and masked
with an attention mask, like a tokenizer called with padding="max_length" would produce.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

PAD_ID = 0


class SyntheticClassification(Dataset):
    """Random "sentences" of varying length, padded to a fixed length, with binary labels."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # Real lengths spread from a quarter of seq_len to all of it: most of the batch is padding.
        self.lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (size,), generator=g)
        self.tokens = torch.randint(1, vocab_size, (size, seq_len), generator=g)  # ids 1.., 0 is padding
        self.labels = torch.randint(0, 2, (size,), generator=g)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(self.seq_len) < self.lengths[i]).long()
        input_ids = self.tokens[i] * mask + PAD_ID * (1 - mask)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": self.labels[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64, help="pad every sequence to this length")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    model = p.add_argument_group("model size (defaults: tiny; BERT-base: 12/768/12/3072/30522/512)")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--heads", type=int, default=2)
    model.add_argument("--intermediate", type=int, default=128)
    model.add_argument("--vocab", type=int, default=1000)
    model.add_argument("--max-pos", type=int, default=128)
    args = p.parse_args(argv)
    if args.seq_len > args.max_pos:
        p.error(f"--seq-len {args.seq_len} is longer than --max-pos {args.max_pos}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    config = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_pos,
        num_labels=2,
    )
    model = BertForSequenceClassification(config).to(device)
    model.train()

    dataset = SyntheticClassification(args.steps * args.batch_size, args.seq_len, args.vocab, seed=args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        pin_memory=device.type == "cuda",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    while step < args.steps:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            print(f"step {step}/{args.steps}  loss {loss.item():.4f}")
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
