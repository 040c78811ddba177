"""An LBFGS loop with a closure (the shape of pytorch/examples' time_sequence_prediction): each
``optimizer.step(closure)`` calls the closure, a forward and a backward, several times; a no-grad
prediction of the same model follows each step. Float64, as that example is. It knows nothing of
memdoctor."""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, 12)
        self.linear = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(0), 12, dtype=x.dtype)
        c = torch.zeros(x.size(0), 12, dtype=x.dtype)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outputs.append(self.linear(h))
        return torch.cat(outputs, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    t = torch.linspace(0, 6.28, 21, dtype=torch.float64)
    data = torch.sin(t + torch.rand(8, 1, dtype=torch.float64))
    x, y = data[:, :-1], data[:, 1:]
    model = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5)
    for _ in range(args.steps):

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            model(x[:2])
    print("done")


if __name__ == "__main__":
    main()
