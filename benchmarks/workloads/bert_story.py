"""The story's workload: fine-tune BERT-base for sequence classification in a plain PyTorch loop.

BERT-base (`BertConfig()` defaults: 12 layers, hidden 768, ~110M parameters) with a 2-class head, batch 32,
every sequence padded to 512 tokens, fp32, AdamW(lr=3e-5). This is the run that did not fit the story's
8 GB card; memdoctor benchmarks its profiler overhead and its predictions on it:

    python benchmarks/workloads/bert_story.py --steps 20 --timing-file /tmp/bert_steps.jsonl
    memdoctor profile benchmarks/workloads/bert_story.py -- --timing-file /tmp/bert_steps_profiled.jsonl

`--tiny` builds a 2-layer, 64-wide BERT (and, unless given, batch 4 and length 64) for a CPU smoke run.

The story's hand-tuning levers, for `benchmarks/story_scenario.py`'s grid (all off by default, so the
defaults are the story's run): `--checkpoint-every N` (activation checkpointing of every N-th encoder
layer, `torch.utils.checkpoint`, non-reentrant), `--micro-batch M` (split each batch into micro-batches of
M with gradient accumulation: the effective batch and the optimizer-step count stay), `--trim-padding`
(cut the all-padding columns of each batch on the host, to a multiple of 8), `--bf16`. `--memory-cap-gib G`
(or the environment variable `STORY_MEMORY_CAP_GIB`) caps the process's CUDA memory the way
`memdoctor profile --budget` does (`torch.cuda.set_per_process_memory_fraction(G GiB / total)`), so a bare
run sees the same card as a profiled one. `--peak-file PATH` writes one JSON object at the end (also after
an OOM): `max_reserved_bytes`, `max_allocated_bytes` (null on a CPU), `oom`, `steps`.

Timing: with `--timing-file PATH`, one JSON line `{"step": i, "step_ms": ...}` is appended to PATH after
every optimizer step i (1-based) and flushed at once, so a run stopped at any point leaves complete lines.
`step_ms` is the wall time between consecutive step ends, each taken after `torch.cuda.synchronize()` on
CUDA; step 1 is timed from the start of the loop, so it includes the first batch and any warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any, TextIO

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

PAD_ID = 0


class PaddedClassification(Dataset):
    """Synthetic token sequences with variable real lengths, each padded to seq_len; made on the host."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (size,), generator=g)
        self.tokens = torch.randint(1, vocab_size, (size, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (size,), generator=g)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(self.seq_len) < self.lengths[i]).long()
        input_ids = self.tokens[i] * mask + PAD_ID * (1 - mask)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": self.labels[i]}


class StepTimer:
    """Appends {"step", "step_ms"} JSON lines, one per optimizer step, flushed as they are written."""

    def __init__(self, path: str | None, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.file: TextIO | None = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self.last = self._now()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_end(self, step: int) -> None:
        if self.file is None:
            return
        now = self._now()
        self.file.write(json.dumps({"step": step, "step_ms": round((now - self.last) * 1e3, 3)}) + "\n")
        self.file.flush()
        self.last = now

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (4 with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="pad to this; default 512 (64 with --tiny)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--bf16", action="store_true", help="run forward and loss under torch.autocast(bfloat16)")
    p.add_argument("--fp16", action="store_true", help="torch.autocast(float16) with a torch.amp.GradScaler")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a CPU smoke run")
    p.add_argument("--attn", choices=["eager", "sdpa"], default="sdpa", help="attn_implementation")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_run_flags(p)
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N-th layer")
    p.add_argument("--micro-batch", type=int, default=None, metavar="M", help="accumulate micro-batches of M")
    p.add_argument("--trim-padding", action="store_true", help="cut all-padding columns of each batch")
    args = p.parse_args(argv)
    if args.bf16 and args.fp16:
        p.error("--bf16 and --fp16 exclude each other")
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 32
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 512
    return args


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags every scenario workload shares (benchmarks/story_scenario.py passes them): seed, the
    per-step timing file, the CUDA memory cap and the peak-memory file."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-file", default=None, metavar="PATH", help="append per-step JSON timing lines")
    p.add_argument("--memory-cap-gib", type=float, default=env_cap(), metavar="G", help="cap CUDA memory")
    p.add_argument("--peak-file", default=None, metavar="PATH", help="write the peak memory as JSON at exit")


def env_cap() -> float | None:
    value = os.environ.get("STORY_MEMORY_CAP_GIB")
    return float(value) if value else None


def apply_cap(device: torch.device, cap_gib: float | None) -> None:
    """Cap CUDA memory as ``memdoctor.device.CudaDevice.apply_cap`` does (no cap at or above the card)."""
    if cap_gib is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    cap = int(cap_gib * 1024**3)
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, index)


class Checkpointed(torch.nn.Module):
    """Recompute ``inner`` in backward instead of keeping its activations (non-reentrant checkpoint)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: BertForSequenceClassification, every: int) -> None:
    """Wrap encoder layers 0, N, 2N, ... in ``Checkpointed`` (every layer for N = 1)."""
    layers = model.bert.encoder.layer
    for i in range(0, len(layers), every):
        layers[i] = Checkpointed(layers[i])


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns no sequence of the batch uses (host tensors: no device sync), to a multiple of 8."""
    mask = batch["attention_mask"]
    longest = int(mask.sum(dim=1).max())
    keep = min(mask.shape[1], -(-longest // 8) * 8)
    return {k: (v[:, :keep] if v.dim() == 2 else v) for k, v in batch.items()}


def micro_batches(batch: dict[str, torch.Tensor], size: int | None) -> list[dict[str, torch.Tensor]]:
    n = len(batch["labels"])
    if not size or size >= n:
        return [batch]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def write_peak(path: str | None, device: torch.device, oom: bool, steps: int) -> None:
    if not path:
        return
    cuda = device.type == "cuda"
    peak = {
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "oom": oom,
        "steps": steps,
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(peak, fh)


def build_config(args: argparse.Namespace) -> BertConfig:
    if args.tiny:
        return BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            vocab_size=1000,
            num_labels=2,
            attn_implementation=args.attn,
        )
    return BertConfig(num_labels=2, attn_implementation=args.attn)  # BERT-base


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    apply_cap(device, args.memory_cap_gib)

    config = build_config(args)
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} > max positions {config.max_position_embeddings}")
    model = BertForSequenceClassification(config)
    if args.checkpoint_every:
        checkpoint_layers(model, args.checkpoint_every)
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dataset = PaddedClassification(args.steps * args.batch_size, args.seq_len, config.vocab_size, args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(args.seed),
    )
    timer = StepTimer(args.timing_file, device)
    step, oom = 0, False
    try:
        step, loss = train(args, model, optimizer, loader, device, timer)
    except torch.OutOfMemoryError:
        oom = True
        raise
    finally:
        timer.close()
        write_peak(args.peak_file, device, oom, step)
    if loss is not None:
        print(f"trained {step} steps, last loss {loss.item():.4f}")


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    device: torch.device,
    timer: StepTimer,
) -> tuple[int, torch.Tensor | None]:
    """The plain loop: forward, backward (over the micro-batches), optimizer step."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=args.fp16)
    step, loss = 0, None
    while step < args.steps:
        for batch in loader:
            if args.trim_padding:
                batch = trim_padding(batch)
            parts = micro_batches(batch, args.micro_batch)
            for part in parts:
                part = {k: v.to(device, non_blocking=True) for k, v in part.items()}
                with autocast:
                    loss = model(**part).loss
                scaler.scale(loss / len(parts)).backward()
            scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            timer.step_end(step)
            if step >= args.steps:
                break
    return step, loss


if __name__ == "__main__":
    main()
