"""Train a small transformer classifier with PyTorch Lightning.

Here the loop lives inside `lightning.pytorch.Trainer`: the script defines a `LightningModule` with
`training_step` and `configure_optimizers`, and calls `trainer.fit()`. memdoctor profiles it unmodified:

    memdoctor profile examples/lightning_train.py -- --batch-size 16

The model is a tiny `nn.TransformerEncoder` over synthetic token ids; it runs in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TransformerClassifier(pl.LightningModule):
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_classes: int,
        lr: float,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=4 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_classes)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos[:, : tokens.shape[1]])
        return self.head(h.mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = self.loss_fn(self(tokens), labels)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (Trainer max_steps)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--precision", default="32-true", help='Lightning precision, e.g. "bf16-mixed"')
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)

    n = args.steps * args.batch_size
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (n, args.seq_len), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    loader = DataLoader(
        TensorDataset(tokens, labels),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )

    model = TransformerClassifier(
        args.vocab, args.seq_len, args.d_model, args.layers, args.heads, n_classes=2, lr=args.lr
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="auto",
        devices=1,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="lightning_"),
    )
    trainer.fit(model, train_dataloaders=loader)
    print(f"trained {trainer.global_step} steps")


if __name__ == "__main__":
    main()
