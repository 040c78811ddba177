"""A GAN loop of pytorch/examples dcgan's shape: each iteration steps the discriminator's optimizer
(after two backwards, real and fake) and then the generator's (a forward of the discriminator after its
step). It knows nothing of memdoctor. ``--g-first`` builds and first calls the generator before the
discriminator, so that the two models are met in the other order."""

from __future__ import annotations

import argparse

import torch
from torch import nn

NZ, NF = 8, 16


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NZ, NF), nn.ReLU(), nn.Linear(NF, NF), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(NF, NF), nn.LeakyReLU(0.2), nn.Linear(NF, 1), nn.Sigmoid())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--d-first", action="store_true", help="build the discriminator first")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.d_first:
        net_d, net_g = discriminator(), generator()
    else:
        net_g, net_d = generator(), discriminator()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    criterion = nn.BCELoss()
    for _ in range(args.steps):
        real = torch.randn(args.batch, NF)
        ones, zeros = torch.ones(args.batch, 1), torch.zeros(args.batch, 1)
        net_d.zero_grad()
        criterion(net_d(real), ones).backward()
        fake = net_g(torch.randn(args.batch, NZ))
        criterion(net_d(fake.detach()), zeros).backward()
        opt_d.step()
        net_g.zero_grad()
        criterion(net_d(fake), ones).backward()
        opt_g.step()
    print("done")


if __name__ == "__main__":
    main()
