"""ViT-base/16 image classification with PyTorch Lightning: the scenario's Lightning model (issue 5, point 6).

A `LightningModule` around HF `ViTForImageClassification` (ViT-base/16, 224×224, 10 classes, built from
its config as in vit_train.py: no download), AdamW(lr 1e-4) in `configure_optimizers`, synthetic images
in a DataLoader, batch 64, fp32 (`precision="32-true"`). The loop lives inside `lightning.pytorch.Trainer`:

    python benchmarks/workloads/vit_lightning.py --steps 20 --timing-file /tmp/vit_steps.jsonl
    memdoctor profile --budget 8GiB benchmarks/workloads/vit_lightning.py -- --steps 6

The levers of `benchmarks/story_scenario.py --workload vit-lightning`, through Lightning's and HF's own
switches: `--accumulate N` (loader batches of batch-size/N, `accumulate_grad_batches=N`: the effective
batch stays), `--precision` (e.g. `bf16-mixed`), `--gradient-checkpointing` (the HF model's own
`gradient_checkpointing_enable`, non-reentrant; `activation_checkpointing_enable` in newer transformers).
`--memory-cap-gib G` (or `STORY_MEMORY_CAP_GIB`) and `--peak-file PATH` as in bert_story.py (the same
functions). `--tiny`: 2 layers, 64 wide, 32×32 images (and, unless given, batch 4): a CPU smoke run.

Timing: with `--timing-file PATH`, one JSON line `{"step": i, "step_ms": ...}` per optimizer step i
(1-based, the Trainer's global_step, which counts optimizer steps, not loader batches), flushed at once;
`step_ms` is the wall time between consecutive step ends, each read after `torch.cuda.synchronize()` on
CUDA; step 1 is timed from `on_train_start`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from bert_story import add_run_flags, apply_cap, write_peak  # the story workload's flags, cap and peak file
from torch.utils.data import DataLoader, TensorDataset
from transformers import ViTConfig, ViTForImageClassification
from vit_train import build_config  # the same ViT-base/16 (or tiny ViT) as the plain-loop workload


class ViTClassifier(pl.LightningModule):
    def __init__(self, config: ViTConfig, lr: float, gradient_checkpointing: bool) -> None:
        super().__init__()
        self.lr = lr
        self.model = ViTForImageClassification(config)
        if gradient_checkpointing:
            enable_checkpointing(self.model)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss: torch.Tensor = self.model(pixel_values=images, labels=labels).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def enable_checkpointing(model: ViTForImageClassification) -> None:
    """HF's own switch (renamed ``activation_checkpointing_enable`` in transformers 5.2x), non-reentrant."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:  # transformers 5.2x: the kwargs were renamed with the method
        new(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class StepTiming(pl.Callback):
    """Appends {"step", "step_ms"} JSON lines, one per optimizer step, flushed as they are written."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in on_train_end)
        self.last = time.perf_counter()
        self.step = 0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last = self._now()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:  # an accumulating batch: no optimizer step yet
            return
        now = self._now()
        self.step = trainer.global_step
        self.file.write(json.dumps({"step": self.step, "step_ms": round((now - self.last) * 1e3, 3)}) + "\n")
        self.file.flush()
        self.last = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.file.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="effective batch; default 64 (4 with --tiny)")
    p.add_argument("--accumulate", type=int, default=1, metavar="N", help="loader batches of batch-size/N")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (Trainer max_steps)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--precision", default="32-true", help='Lightning precision, e.g. "bf16-mixed"')
    p.add_argument("--gradient-checkpointing", action="store_true", help="the HF model's own checkpointing")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 32x32 images: a CPU smoke run")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="Lightning accelerator")
    add_run_flags(p)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 64
    if args.accumulate < 1 or args.batch_size % args.accumulate:
        p.error(f"--accumulate {args.accumulate} must divide --batch-size {args.batch_size}")
    return args


def loader(args: argparse.Namespace, config: ViTConfig, pin: bool) -> DataLoader:
    """Synthetic images and labels, made on the host like a real loader's; batches of batch-size/N."""
    n, size, classes = args.steps * args.batch_size, config.image_size, config.num_labels
    assert isinstance(size, int) and classes  # build_config's: square images, 10 classes
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randn(n, 3, size, size, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(
        TensorDataset(images, labels),
        batch_size=args.batch_size // args.accumulate,
        shuffle=True,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(args.seed),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    apply_cap(device, args.memory_cap_gib)  # before the model is built

    config = build_config(args.tiny)
    module = ViTClassifier(config, args.lr, args.gradient_checkpointing)
    data = loader(args, config, pin=cuda)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="auto" if args.device == "auto" else args.device,
        devices=1,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        callbacks=[StepTiming(args.timing_file)] if args.timing_file else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="vit_lightning_"),  # nothing is saved there
    )
    oom = False
    try:
        trainer.fit(module, train_dataloaders=data)
    except torch.OutOfMemoryError:
        oom = True
        raise
    finally:
        write_peak(args.peak_file, device, oom, trainer.global_step)
    print(f"trained {trainer.global_step} steps")


if __name__ == "__main__":
    main()
