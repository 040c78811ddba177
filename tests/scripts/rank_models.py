"""Two small one-process training scripts for the per-rank accuracy benchmark and tests (issue 17, point 6:
benchmarks/rank_accuracy.py, tests/test_rank_accuracy.py).

``--model mlp``: a stack of residual MLP blocks over random features (a regression); ``--model
transformer``: a small pre-norm decoder (embedding, blocks of attention + MLP, a head) over random
tokens. Both know nothing of ranks: a DataLoader of ``--samples`` samples in batches of ``--batch-size``,
AdamW, one optimizer step per batch, at most ``--steps`` steps. Under ``memdoctor run|profile --config``
with ``parallel`` each rank reads 1/N of every batch (a ``DistributedSampler``); the repeated blocks are
``blocks.0`` ... ``blocks.K-1``, the ``shard_modules`` an FSDP2 plan names.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, features: int = 64, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class DecoderBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(
        self, vocab: int = 512, width: int = 128, depth: int = 4, heads: int = 4, seq: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(DecoderBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SEQ, VOCAB, FEATURES = 32, 512, 64


def data(model: str, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if model == "mlp":
        return TensorDataset(
            torch.randn(samples, FEATURES, generator=g), torch.randn(samples, 1, generator=g)
        )
    ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def loss_of(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return nn.functional.mse_loss(model(x), y)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, help="default: enough for --steps batches")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    model = MLP(FEATURES) if args.model == "mlp" else Decoder(VOCAB, seq=SEQ)
    samples = args.samples or args.batch_size * args.steps
    loader = DataLoader(data(args.model, samples), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = loss_of(model, args.model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"{args.model}: {step} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
