"""A minimal GPT trainer of the kind many people start from (nanoGPT's shape), written for memdoctor's
corpus: the model's ``forward(idx, targets)`` returns ``(logits, loss)``, computing the loss in the root
module's own code with an fp32 upcast of the logits; the script runs its own
``torch.autocast(bfloat16)`` context (which works on a CPU too); batches come from a ``get_batch()``
function slicing one token tensor (no DataLoader); ``--batch-size`` and ``--grad-accum`` arguments;
AdamW over weight-decay groups; a cosine learning rate with warm-up set by hand on the param groups;
gradient clipping; a GradScaler that is off unless fp16. Tiny: 2 blocks of width 32, a few iterations.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "h": nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:  # the loss in the root's own code, in fp32
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [q for q in self.parameters() if q.requires_grad]
        groups = [
            {"params": [q for q in params if q.dim() >= 2], "weight_decay": weight_decay},
            {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-iters", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=6e-4)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args()
    torch.manual_seed(1337)
    vocab = 96
    train_data = torch.randint(0, vocab, (4096,))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(train_data) - args.block_size, (args.batch_size,))
        x = torch.stack([train_data[i : i + args.block_size] for i in ix])
        y = torch.stack([train_data[i + 1 : i + 1 + args.block_size] for i in ix])
        return x, y

    def get_lr(it: int, warmup: int = 2) -> float:
        if it < warmup:
            return args.learning_rate * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / max(1, args.max_iters - warmup)
        return 0.1 * args.learning_rate + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * args.learning_rate

    model = GPT(vocab, args.block_size, n_layer=2, n_head=2, n_embd=32)
    optimizer = model.configure_optimizers(0.1, args.learning_rate)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    ctx = torch.autocast(device_type="cpu", dtype=ptdtype)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    X, Y = get_batch()
    for it in range(args.max_iters):
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(args.grad_accum):
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / args.grad_accum
            X, Y = get_batch()  # the next batch while the backward runs
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}, lr {lr:.2e}")


if __name__ == "__main__":
    main()
