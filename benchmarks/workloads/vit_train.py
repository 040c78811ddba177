"""A vision workload: fine-tune ViT-base/16 (HF transformers, ~86M parameters) on 224×224 images in a
plain PyTorch loop, fp32, AdamW. Synthetic images and labels, made on the host like a real loader's.

    python benchmarks/workloads/vit_train.py --steps 20
    memdoctor profile --budget 8GiB benchmarks/workloads/vit_train.py -- --batch-size 64

`--tiny` builds a 2-layer, 64-wide ViT on 32×32 images for a CPU smoke run. `--timing-file` as in
bert_story.py (one JSON line per optimizer step).
"""

from __future__ import annotations

import argparse

import torch
from bert_story import StepTimer  # the same per-step timing lines as the story's workload
from torch.utils.data import DataLoader, TensorDataset
from transformers import ViTConfig, ViTForImageClassification


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (4 with --tiny)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 32x32 images: a CPU smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-file", default=None, metavar="PATH", help="append per-step JSON timing lines")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 64
    return args


def build_config(tiny: bool) -> ViTConfig:
    if tiny:
        return ViTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
            num_labels=10,
        )
    return ViTConfig(num_labels=10)  # ViT-base/16, 224x224


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    config = build_config(args.tiny)
    model = ViTForImageClassification(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n, size = args.steps * args.batch_size, config.image_size
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randn(n, 3, size, size, generator=g)
    labels = torch.randint(0, config.num_labels, (n,), generator=g)
    pin = device.type == "cuda"
    data = TensorDataset(images, labels)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, pin_memory=pin)
    timer = StepTimer(args.timing_file, device)
    step, loss = 0, None
    try:
        while step < args.steps:
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = model(pixel_values=x, labels=y).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                timer.step_end(step)
                if step >= args.steps:
                    break
    finally:
        timer.close()
    if loss is not None:
        print(f"trained {step} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
