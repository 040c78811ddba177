"""A GAN trained the way pytorch/examples' ``dcgan/main.py --dataset fake`` does it, written for memdoctor's
corpus: a generator ``netG`` (transposed convolutions) and a discriminator ``netD`` (convolutions), each
with its own Adam, ``nn.BCELoss``, and per batch three backward passes (D on real, D on fake, G through D)
with two optimizer steps. Fake 16x16 images; tiny filters; a few batches.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Generator(nn.Module):
    def __init__(self, nz: int, ngf: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 3, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),  # 1x1
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batchSize", type=int, default=16)
    p.add_argument("--nz", type=int, default=16)
    p.add_argument("--ngf", type=int, default=8)
    p.add_argument("--ndf", type=int, default=8)
    p.add_argument("--niter", type=int, default=1)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.0002)
    args = p.parse_args()
    torch.manual_seed(0)
    images = torch.rand(args.batchSize * args.batches, 3, 16, 16) * 2 - 1
    dataloader = DataLoader(TensorDataset(images), batch_size=args.batchSize, shuffle=True)
    netG, netD = Generator(args.nz, args.ngf), Discriminator(args.ndf)
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    real_label, fake_label = 1.0, 0.0
    for epoch in range(args.niter):
        for i, (real,) in enumerate(dataloader):
            # (1) D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label)
            errD_real = criterion(netD(real), label)
            errD_real.backward()
            noise = torch.randn(batch_size, args.nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            errD_fake = criterion(netD(fake.detach()), label)
            errD_fake.backward()
            optimizerD.step()
            # (2) G: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            errG = criterion(netD(fake), label)
            errG.backward()
            optimizerG.step()
            print(f"[{epoch}][{i}] Loss_D {(errD_real + errD_fake).item():.4f} Loss_G {errG.item():.4f}")


if __name__ == "__main__":
    main()
