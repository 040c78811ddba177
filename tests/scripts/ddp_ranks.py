"""A tiny DDP training loop written for ``torchrun``: it makes the process group from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), knows nothing of memdoctor, and can fail on one rank.

``--fail-rank R --fail-step K --fail raise|oom|hang``: rank R raises (a RuntimeError, or the
``torch.OutOfMemoryError`` a CUDA allocation raises), or sleeps for an hour, at step K (the other
ranks then wait in the step's all-reduce). ``--sync ddp|allreduce``: DDP, or the gradients
all-reduced by hand (the same collective without DDP's start-up, for the quicker failure tests).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--fail", choices=("raise", "oom", "hang"), default="raise")
    p.add_argument("--sync", choices=("ddp", "allreduce"), default="ddp")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if args.sync == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step:
            if args.fail == "raise":
                raise RuntimeError(f"rank {rank} failed on purpose at step {step}")
            if args.fail == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory (rank {rank}, on purpose)")
            time.sleep(3600)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if args.sync == "allreduce":
            for param in model.parameters():
                dist.all_reduce(param.grad)
        opt.step()
    print(f"rank {rank} of {dist.get_world_size()} done (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
