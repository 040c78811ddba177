"""A torchvision ResNet-50 in the plain loop most image-classification scripts have: the model returns
logits, the loss is computed in the loop (``nn.CrossEntropyLoss``), SGD with momentum and a StepLR
schedule, batches of 128 random 224x224 images from a ``DataLoader`` (issue 15, point 7):

    python benchmarks/workloads/resnet_loop.py --steps 12 --timing-file /tmp/resnet_steps.jsonl
    memdoctor profile --budget 8GiB benchmarks/workloads/resnet_loop.py -- --steps 12

Its hand levers, off by default (``benchmarks/story_scenario.py --workload resnet-loop`` runs the grid):
``--bf16`` (the loop's own ``torch.autocast(bfloat16)``), ``--channels-last``, ``--micro-batch M``
(each batch split into micro-batches of M with gradient accumulation: the effective batch and the step
count stay), ``--checkpoint-stages`` (each of layer1..layer4's bottleneck blocks under
``torch.utils.checkpoint``). ``--tiny`` is a ResNet-18 on 32x32 images, batch 8, for a CPU smoke run.
The shared flags (``--timing-file``, ``--memory-cap-gib``, ``--peak-file``, ``--seed``) are
``bert_story.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from bert_story import Checkpointed, StepTimer, add_run_flags, apply_cap, write_peak
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="default 128 (8 with --tiny)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--tiny", action="store_true", help="ResNet-18 on 32x32 images: a CPU smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="forward and loss under torch.autocast(bfloat16)")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--micro-batch", type=int, default=None, metavar="M")
    p.add_argument("--checkpoint-stages", action="store_true", help="checkpoint every bottleneck block")
    add_run_flags(p)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 8 if args.tiny else 128
    return args


def build(args: argparse.Namespace) -> tuple[nn.Module, int]:
    """The model and its image size (torchvision imported here: the argument parser needs none)."""
    import torchvision

    if args.tiny:
        return torchvision.models.resnet18(num_classes=10), 32
    return torchvision.models.resnet50(num_classes=1000), 224


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    apply_cap(device, args.memory_cap_gib)
    model, size = build(args)
    if args.checkpoint_stages:
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            for i in range(len(stage)):
                stage[i] = Checkpointed(stage[i])
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=fmt)
    model.train()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    g = torch.Generator().manual_seed(args.seed)
    pool = 2 * args.batch_size  # a fixed pool of random images: making them per batch would time the host
    classes = 10 if args.tiny else 1000
    data = TensorDataset(
        torch.randn(pool, 3, size, size, generator=g), torch.randint(0, classes, (pool,), generator=g)
    )
    loader = DataLoader(
        data, batch_size=args.batch_size, shuffle=True, drop_last=True, pin_memory=device.type == "cuda"
    )
    timer = StepTimer(args.timing_file, device)
    step, oom, loss = 0, False, None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    try:
        while step < args.steps:
            for images, target in loader:
                images = images.to(device, non_blocking=True, memory_format=fmt)
                target = target.to(device, non_blocking=True)
                optimizer.zero_grad()
                parts = args.micro_batch or args.batch_size
                for i in range(0, args.batch_size, parts):
                    with autocast:
                        output = model(images[i : i + parts])
                        loss = criterion(output, target[i : i + parts]) * (len(output) / args.batch_size)
                    loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                timer.step_end(step)
                if step >= args.steps:
                    break
    except torch.OutOfMemoryError:
        oom = True
        raise
    finally:
        timer.close()
        write_peak(args.peak_file, device, oom, step)
    if loss is not None:
        print(f"trained {step} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
