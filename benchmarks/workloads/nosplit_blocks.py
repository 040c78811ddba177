"""A ``get_batch()`` loop with no split for memdoctor's micro-batching: the model returns logits, the loop
computes the loss, batches come from no DataLoader and the script has no batch-size or accumulation
argument. Its 8 blocks hold ~1.3 GiB of activations at batch 8192 (``BATCH`` overrides): under a 1.2 GiB
``--budget`` its first step runs out of memory, so ``memdoctor profile --reprofile`` re-profiles it with
every block checkpointed (docs/planner.md). Used by benchmarks/reprofile_checkpoint.sh."""

import os

import torch
from torch import nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
BATCH = int(os.environ.get("BATCH", "8192"))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 1024, n: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 64, device=device), torch.randint(0, 10, (BATCH,), device=device)


model = Net().to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
for _ in range(6):
    x, y = get_batch()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
