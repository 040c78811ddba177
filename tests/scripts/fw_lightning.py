"""A tiny LightningModule trained by a Lightning Trainer; dumps what the Trainer actually used.

Used by tests/test_runtime_frameworks.py: run as-is and under memdoctor's framework patches.
``python fw_lightning.py OUT.json [--accumulate 1] [--precision P] [--loader plain|subclass] [--package P]``
"""

import argparse
import importlib
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--samples", type=int, default=24)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--precision", default=None)
parser.add_argument("--loader", choices=("plain", "subclass"), default="plain")
parser.add_argument(
    "--package", choices=("lightning.pytorch", "pytorch_lightning"), default="lightning.pytorch"
)
opts = parser.parse_args()
pl = importlib.import_module(opts.package)


class MyLoader(DataLoader):
    """A DataLoader subclass: memdoctor cannot know how to rebuild it."""


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(int(x.shape[0]))
        return torch.nn.functional.mse_loss(self.layer(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(opts.samples, 4), torch.randn(opts.samples, 1))
loader = (MyLoader if opts.loader == "subclass" else DataLoader)(data, batch_size=opts.batch, shuffle=True)
model = Tiny()
kwargs = {"precision": opts.precision} if opts.precision else {}
trainer = pl.Trainer(
    max_epochs=1,
    accelerator="cpu",
    devices=1,
    accumulate_grad_batches=opts.accumulate,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    **kwargs,
)
trainer.fit(model, loader)
result = {
    "accumulate_grad_batches": trainer.accumulate_grad_batches,
    "precision": str(trainer.precision),
    "optimizer_steps": trainer.global_step,
    "batch_sizes": model.seen,
    "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
}
with open(opts.out, "w") as f:
    json.dump(result, f)
