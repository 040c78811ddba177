"""An image classifier trained the way timm's ``train.py`` does it, written for memdoctor's corpus: a model
from a ``create_model(name, num_classes=...)`` factory (a tiny ViT: ``patch_embed``, ``blocks``, ``norm``,
``head``), a label-smoothing cross entropy computed in the loop, an ``amp_autocast`` context
(``contextlib.suppress`` when AMP is off, as timm does on a CPU), a ``GradScaler(enabled=False)`` around
backward and step, AdamW, and a cosine schedule stepped per update by hand (timm's ``step_update``).
timm is not a dependency of the test suite, so the model is its own. Random 32x32 images; a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, num_classes: int, dim: int = 32, depth: int = 2, patch: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (32 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, 2) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


MODELS: dict[str, Callable[..., nn.Module]] = {"vit_tiny_test": VisionTransformer}


def create_model(name: str, **kwargs: int) -> nn.Module:
    return MODELS[name](**kwargs)


def cosine_lr(base: float, update: int, total: int, warmup: int) -> float:
    if update < warmup:
        return base * (update + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (update - warmup) / max(1, total - warmup)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_tiny_test")
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()
    torch.manual_seed(42)
    model = create_model(args.model, num_classes=10)
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * args.batches
    data = TensorDataset(torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    train_loss_fn = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    amp_autocast = contextlib.suppress  # timm's choice when AMP is off
    loss_scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    model.train()
    for batch_idx, (inp, target) in enumerate(loader):
        with amp_autocast():
            output = model(inp)
            loss = train_loss_fn(output, target)
        optimizer.zero_grad()
        loss_scaler.scale(loss).backward()
        loss_scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        loss_scaler.step(optimizer)
        loss_scaler.update()
        num_updates = batch_idx + 1
        for group in optimizer.param_groups:  # lr_scheduler.step_update(num_updates)
            group["lr"] = cosine_lr(args.lr, num_updates, len(loader), 2)
        print(f"batch {batch_idx} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
