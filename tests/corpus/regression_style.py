"""A polynomial fit trained the way pytorch/examples' ``regression/main.py`` does it, written for
memdoctor's corpus: one ``nn.Linear`` over the features [x, x^2, x^3, x^4], a fresh random batch from
``get_batch()`` each iteration, ``F.smooth_l1_loss``, and the parameters updated by hand
(``param.data.add_(-lr * param.grad)``) until the loss is small: no ``torch.optim``. Capped at
``--max-batches`` so that it always ends.
"""

from __future__ import annotations

import argparse
from itertools import count

import torch
import torch.nn.functional as F

POLY_DEGREE = 4
torch.manual_seed(0)
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x: torch.Tensor) -> torch.Tensor:
    x = x.unsqueeze(1)
    return torch.cat([x**i for i in range(1, POLY_DEGREE + 1)], 1)


def get_batch(batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = make_features(torch.randn(batch_size))
    return x, x.mm(W_target) + b_target.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2048)  # examples: 32, which peaks under 1 KiB
    args = p.parse_args()
    fc = torch.nn.Linear(POLY_DEGREE, 1)
    loss = float("inf")
    batch_idx = 0
    for batch_idx in count(1):
        batch_x, batch_y = get_batch(args.batch_size)
        fc.zero_grad()
        output = F.smooth_l1_loss(fc(batch_x), batch_y)
        loss = output.item()
        output.backward()
        for param in fc.parameters():
            param.data.add_(-0.1 * param.grad)
        if loss < 1e-3 or batch_idx >= args.max_batches:
            break
    print(f"Loss: {loss:.6f} after {batch_idx} batches")


if __name__ == "__main__":
    main()
