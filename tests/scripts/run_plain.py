"""A plain PyTorch loop over a tiny classifier that computes its own loss (HF-style ``labels``), for
``memdoctor run`` tests. It knows nothing of memdoctor; what it did goes to --out (JSON) and the
gradients of its first backward to --grads (torch.save), for comparison with an unmodified run."""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SEQ, VOCAB, DIM = 24, 50, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.nn.functional.gelu(self.ff(x)))


class TinyClassifier(nn.Module):
    def __init__(self, with_loss: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(DIM, 2)
        self.with_loss = with_loss

    def forward(self, input_ids, attention_mask, labels=None):  # type: ignore[no-untyped-def]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        logits = self.head((x * m).sum(1) / m.sum(1))
        if not self.with_loss:
            return logits
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.float(), labels)
        return out


class Data(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.lengths = torch.randint(4, SEQ - 6, (n,), generator=g)  # the last 6 columns are always padding
        self.tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        return {"input_ids": self.tokens[i] * mask, "attention_mask": mask, "labels": self.labels[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out")
    p.add_argument("--grads")
    p.add_argument("--divide", type=float, default=1.0, help="backpropagate loss / DIVIDE")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--own-loss", action="store_true", help="compute the loss outside the model")
    p.add_argument("--exit", type=int, default=None)
    p.add_argument("--closure", action="store_true", help="optimizer.step(closure), as Lightning does")
    p.add_argument("--zeros", action="store_true", help="zero_grad(set_to_none=False)")
    p.add_argument("--peek", action="store_true", help="a training-mode forward it never backpropagates")
    p.add_argument(
        "--holder", action="store_true", help="optimize a holder module, call its child (Lightning)"
    )
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyClassifier(with_loss=not args.own_loss)
    # --holder: like a LightningModule around the network it calls
    trained = nn.ModuleDict({"net": model}) if args.holder else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    loader = DataLoader(Data(args.steps * args.batch_size), batch_size=args.batch_size)
    losses, lrs, widths = [], [], []
    if args.zeros:  # gradients exist (zeros) before the first backward
        optimizer.zero_grad(set_to_none=False)
        for q in model.parameters():
            q.grad = torch.zeros_like(q)
    for step, batch in enumerate(loader):
        widths.append(batch["input_ids"].shape[1])
        if args.peek:
            model(**batch)
        if args.closure:

            def closure(batch: dict[str, torch.Tensor] = batch) -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(**batch)["loss"]
                loss.backward()
                return loss

            loss = optimizer.step(closure)
            scheduler.step()
            losses.append(loss.item())
            lrs.append(scheduler.get_last_lr()[0])
            continue
        if args.own_loss:
            logits = model(batch["input_ids"], batch["attention_mask"])
            loss = nn.functional.cross_entropy(logits, batch["labels"])
        else:
            loss = model(**batch)["loss"]
        (loss / args.divide).backward()
        if step == 0 and args.grads:
            torch.save({n: q.grad.clone() for n, q in model.named_parameters()}, args.grads)
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=not args.zeros)
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"losses": losses, "lrs": lrs, "widths": widths, "steps": len(losses)}, fh)
    if args.exit is not None:
        raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
