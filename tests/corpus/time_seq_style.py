"""A sequence model trained the way pytorch/examples' ``time_sequence_prediction/train.py`` does it,
written for memdoctor's corpus: two ``nn.LSTMCell`` stepped over the time axis in Python, a float64
model (``.double()``), ``nn.MSELoss`` and ``optim.LBFGS`` whose ``step(closure)`` runs forward and
backward several times per step, then a no-grad prediction of the future each step. Sine waves made in
the script; a short sequence, few LBFGS iterations.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

HIDDEN = 16


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, HIDDEN)
        self.lstm2 = nn.LSTMCell(HIDDEN, HIDDEN)
        self.linear = nn.Linear(HIDDEN, 1)

    def forward(self, inp: torch.Tensor, future: int = 0) -> torch.Tensor:
        outputs = []
        h_t = c_t = h_t2 = c_t2 = torch.zeros(inp.size(0), HIDDEN, dtype=torch.double)
        output = inp[:, :1]
        for input_t in inp.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        return torch.cat(outputs, dim=1)


def sine_waves(n: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    shift = torch.randint(-80, 80, (n, 1), generator=g)
    return torch.sin((torch.arange(length) + shift).double() / 20.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--max-iter", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    data = sine_waves(12, args.length)
    inp, target = data[3:, :-1], data[3:, 1:]
    test_input, test_target = data[:3, :-1], data[:3, 1:]
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=args.max_iter)
    for i in range(args.steps):
        print("STEP:", i)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = criterion(seq(inp), target)
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            future = 10
            pred = seq(test_input, future=future)
            print("test loss:", criterion(pred[:, :-future], test_target).item())


if __name__ == "__main__":
    main()
