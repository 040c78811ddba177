"""A classifier trained the way pytorch/examples' ``imagenet/main.py --dummy`` does it, written for
memdoctor's corpus: a ResNet-shaped network (stem, four stages of basic blocks, average pool, ``fc``),
fake images from a Dataset through a DataLoader, the loss computed in the loop by
``nn.CrossEntropyLoss``, SGD with momentum and weight decay, and ``StepLR`` stepped once an epoch.

torchvision is not a dependency of the test suite, so the network is a small ResNet of its own with
torchvision's module names (``conv1``, ``bn1``, ``layer1`` ... ``layer4``, ``fc``). Tiny on purpose: 32x32
images, 10 classes, a few steps, a couple of seconds on a CPU.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, width: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        widths = [width, width * 2, width * 4, width * 8]
        stages, cin = [], width
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class FakeImages(Dataset):
    """Random images and labels, the same every run (``torchvision.datasets.FakeData``'s idea)."""

    def __init__(self, size: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(size, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def train(
    loader: DataLoader, model: nn.Module, criterion: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    model.train()
    for i, (images, target) in enumerate(loader):
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 4 == 0:
            print(f"batch {i} loss {loss.item():.4f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=3, help="batches per epoch")
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    torch.manual_seed(0)
    model = ResNet(num_classes=10)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.1)
    loader = DataLoader(
        FakeImages(args.batch_size * args.batches, 10), batch_size=args.batch_size, shuffle=True
    )
    for epoch in range(args.epochs):
        train(loader, model, criterion, optimizer)
        scheduler.step()
        print(f"epoch {epoch} lr {scheduler.get_last_lr()[0]:.4f}")


if __name__ == "__main__":
    main()
