"""A GAN loop of pytorch/examples dcgan's shape: a ``Generator`` and a ``Discriminator``, each holding
its layers as ``main`` (so both have modules ``main.0``, ``main.1``, ...); each iteration steps the
discriminator's optimizer (after two backwards, real and fake) and then the generator's (after a forward
of the discriminator following its step). It knows nothing of memdoctor. ``--d-first`` builds the
discriminator and its optimizer first, so that the two models are met in the other order."""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self, nz: int, width: int) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(width, width),
            nn.LeakyReLU(0.2),
            nn.Linear(width, width),
            nn.LeakyReLU(0.2),
            nn.Linear(width, 1),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--nz", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--d-first", action="store_true", help="build the discriminator first")
    args = parser.parse_args()
    torch.manual_seed(0)
    betas = (0.5, 0.999)
    if args.d_first:
        net_d = Discriminator(args.width)
        opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=betas)
        net_g = Generator(args.nz, args.width)
        opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=betas)
    else:
        net_g = Generator(args.nz, args.width)
        opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=betas)
        net_d = Discriminator(args.width)
        opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=betas)
    criterion = nn.BCELoss()
    for _ in range(args.steps):
        real = torch.randn(args.batch, args.width)
        ones, zeros = torch.ones(args.batch, 1), torch.zeros(args.batch, 1)
        net_d.zero_grad()
        criterion(net_d(real), ones).backward()
        fake = net_g(torch.randn(args.batch, args.nz))
        criterion(net_d(fake.detach()), zeros).backward()
        opt_d.step()
        net_g.zero_grad()
        criterion(net_d(fake), ones).backward()
        opt_g.step()
    print("done")


if __name__ == "__main__":
    main()
