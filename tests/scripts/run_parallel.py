"""A one-process training loop over a tiny MLP, for the ``parallel`` tests (tests/test_parallel_apply.py).

It knows nothing of ranks: under ``memdoctor run``'s parallel apply each rank runs it unchanged (the
launcher's RANK only names its output file, --out.rank<K>.json). One epoch over a DataLoader of
``--samples`` samples in batches of ``--batch-size`` (in order, or ``--shuffle``), AdamW; it writes
each step's loss, the loss on all the samples after the last step, and how many optimizer steps it
made. ``--own-group`` starts its own process group first (a script a parallel config must refuse).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--own-group", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.own_group:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.samples, 4, generator=g), torch.randn(args.samples, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=args.shuffle)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, steps = [], 0
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        losses.append(loss.item())
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    out = f"{args.out}.rank{os.environ.get('RANK', '0')}.json"
    with open(out, "w") as fh:
        json.dump({"losses": losses, "final": final, "steps": steps}, fh)


if __name__ == "__main__":
    main()
