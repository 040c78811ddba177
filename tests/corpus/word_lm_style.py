"""An LSTM language model trained the way pytorch/examples' ``word_language_model/main.py`` does it,
written for memdoctor's corpus: the token stream batchified into columns (batches are sequence-first,
``[bptt, batch]``), ``get_batch(source, i)`` slices, the hidden state carried and detached between
batches, ``nn.NLLLoss`` over log-softmax outputs, ``clip_grad_norm_``, and the parameters updated by hand
(``p.data.add_(p.grad, alpha=-lr)``): no ``torch.optim`` at all. A random token stream; a few batches.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.ntoken = nhid, nlayers, ntoken

    def forward(
        self, inp: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        emb = self.drop(self.encoder(inp))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """The stream cut into ``bsz`` columns: row i holds the i-th token of every column."""
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def repackage_hidden(h: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ntokens", type=int, default=200)
    p.add_argument("--emsize", type=int, default=32)
    p.add_argument("--nhid", type=int, default=32)
    p.add_argument("--nlayers", type=int, default=2)
    p.add_argument("--lr", type=float, default=20.0)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--bptt", type=int, default=12)
    p.add_argument("--batches", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(1111)
    stream = torch.randint(0, args.ntokens, (args.batch_size * (args.bptt * args.batches + 1),))
    train_data = batchify(stream, args.batch_size)

    def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = min(args.bptt, len(source) - 1 - i)
        return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)

    model = RNNModel(args.ntokens, args.emsize, args.nhid, args.nlayers)
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)  # type: ignore[assignment]
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for q in model.parameters():
            q.data.add_(q.grad, alpha=-args.lr)
        print(f"batch {batch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
