"""A digit classifier trained the way pytorch/examples' ``mnist_hogwild`` does it, written for memdoctor's
corpus: the model's parameters in shared memory (``model.share_memory()``) and ``--num-processes``
workers started with ``torch.multiprocessing`` (spawn), each running its own DataLoader and SGD over the
shared parameters; ``F.nll_loss`` of log-softmax outputs computed in the loop. ``--num-processes 0``
trains in the main process instead (the same loop, no workers). Random 28x28 "digits"; a few batches.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 128)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def train(rank: int, args: argparse.Namespace, model: nn.Module, dataset: TensorDataset) -> None:
    torch.manual_seed(1 + rank)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        print(f"{os.getpid()} batch {batch_idx} loss {loss.item():.4f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--num-processes", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(1)
    dataset = digits(args.batch_size * args.batches)
    model = Net()
    if args.num_processes == 0:
        train(0, args, model, dataset)
        return
    mp.set_start_method("spawn", force=True)
    model.share_memory()
    processes = [mp.Process(target=train, args=(r, args, model, dataset)) for r in range(args.num_processes)]
    for proc in processes:
        proc.start()
    for proc in processes:
        proc.join()


if __name__ == "__main__":
    main()
