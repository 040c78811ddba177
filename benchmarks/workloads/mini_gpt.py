"""A minimal GPT trainer of the shape many people start from (issue 15, point 7), written for memdoctor's
benchmarks: the script runs its own ``torch.autocast(bfloat16)``, the model's forward returns
``(logits, loss)`` with the loss computed in the root module's own code (after an fp32 upcast of the
logits), batches come from a ``get_batch()`` function (no DataLoader), the script has its own
``--batch-size`` and ``--grad-accum`` arguments and sets a cosine learning rate by hand; AdamW.

    python benchmarks/workloads/mini_gpt.py --steps 12 --timing-file /tmp/gpt_steps.jsonl
    memdoctor profile --budget 8GiB benchmarks/workloads/mini_gpt.py -- --steps 12

Default: 124M parameters (12 layers, 12 heads, width 768, vocabulary 50304), batch 12 x 1024 tokens.
Hand levers: ``--batch-size B --grad-accum N`` (N micro-batches of B per optimizer step: the effective
batch is B x N), ``--checkpoint`` (every block under ``torch.utils.checkpoint``), ``--no-autocast``.
``--tiny`` is a 2-layer, 64-wide model on 64-token sequences, batch 4, for a CPU smoke run. The shared
flags (``--timing-file``, ``--memory-cap-gib``, ``--peak-file``, ``--seed``) are ``bert_story.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
from bert_story import Checkpointed, StepTimer, add_run_flags, apply_cap, write_peak
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, width: int, vocab: int, block: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch (default 12)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default 1024)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--checkpoint", action="store_true", help="checkpoint every block")
    p.add_argument("--no-autocast", action="store_true", help="run in fp32")
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64: a CPU smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_run_flags(p)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 12
    if args.block_size is None:
        args.block_size = 64 if args.tiny else 1024
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    apply_cap(device, args.memory_cap_gib)
    shape = (2, 2, 64, 512) if args.tiny else (12, 12, 768, 50304)
    model = GPT(*shape, block=args.block_size)
    if args.checkpoint:
        for i in range(len(model.blocks)):
            model.blocks[i] = Checkpointed(model.blocks[i])
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, shape[3], (args.block_size * 256,), generator=g)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=g)
        x = torch.stack([data[i : i + args.block_size] for i in ix.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix.tolist()])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    ctx = contextlib.nullcontext() if args.no_autocast else torch.autocast(device.type, dtype=torch.bfloat16)
    timer = StepTimer(args.timing_file, device)
    step, oom, loss = 0, False, None
    try:
        for step in range(1, args.steps + 1):
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(args.grad_accum):
                x, y = get_batch()
                with ctx:
                    _, loss = model(x, y)
                    loss = loss / args.grad_accum
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.step_end(step)
    except torch.OutOfMemoryError:
        oom = True
        raise
    finally:
        timer.close()
        write_peak(args.peak_file, device, oom, step)
    if loss is not None:
        print(f"trained {step} steps, last loss {loss.item() * args.grad_accum:.4f}")


if __name__ == "__main__":
    main()
