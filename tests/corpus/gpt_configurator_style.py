"""A minimal GPT trainer configured as nanoGPT's ``train.py`` is, written for memdoctor's corpus: no
argparse; its settings are module-level globals (``batch_size``, ``gradient_accumulation_steps``, ...)
that ``configurator.py`` (beside it, run with ``exec``) overrides from ``--name=value`` arguments.
Batches come from a ``get_batch()`` function drawing random windows of one token tensor (no
DataLoader); the model returns its logits and the loop computes the loss (in fp32, from the logits),
so neither the forward nor a DataLoader can be split: only the script's own two knobs can make the
micro-batch smaller. Its own ``torch.autocast(bfloat16)``; AdamW; gradient clipping; a learning rate
set by hand on the param groups. Tiny: 2 blocks of width 32, a few iterations.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

# defaults, overridden by configurator.py from --name=value
batch_size = 8
gradient_accumulation_steps = 2
block_size = 32
max_iters = 4
learning_rate = 6e-4
dtype = "bfloat16"
n_layer = 2
n_embd = 32
seed = 1337
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())  # noqa: SIM115
config = {k: globals()[k] for k in config_keys}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


torch.manual_seed(seed)
vocab = 96
train_data = torch.randint(0, vocab, (4096,))


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(train_data) - block_size, (batch_size,))
    x = torch.stack([train_data[i : i + block_size] for i in ix])
    y = torch.stack([train_data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


def get_lr(it: int, warmup: int = 2) -> float:
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / max(1, max_iters - warmup)
    return 0.1 * learning_rate + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * learning_rate


model = GPT(vocab)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
ctx = torch.autocast(device_type="cpu", dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
X, Y = get_batch()
for it in range(max_iters):
    lr = get_lr(it)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for _micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits = model(X)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), Y.view(-1))
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch()  # the next batch while the backward runs
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item() * gradient_accumulation_steps:.4f}, lr {lr:.2e}")
