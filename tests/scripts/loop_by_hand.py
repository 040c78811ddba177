"""A training loop without ``torch.optim`` (the shape of pytorch/examples' word_language_model and
regression): ``model.zero_grad()``, ``loss.backward()``, then every parameter updated by hand through
``p.data``. It knows nothing of memdoctor. ``--evaluate`` runs a no-grad forward of the same model after
each update (a validation pass between steps)."""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--evaluate", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    criterion = nn.MSELoss()
    for _ in range(args.steps):
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        model.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-args.lr)
        if args.evaluate:
            with torch.no_grad():
                model(torch.randn(4, 8))
    print("done")


if __name__ == "__main__":
    main()
