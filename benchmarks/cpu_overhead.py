"""Host-side cost of a ProfileSession, measured on a CPU with a 12-layer tiny BERT.

    python benchmarks/cpu_overhead.py [--profile]

The model has BERT-base's module structure (12 layers, ~230 module calls a forward) but tiny widths, so
a step is dominated by per-module Python work: the regime of a launch-bound GPU step. Prints the median
step time bare and profiled (same process, same data) and their ratio; --profile adds a cProfile table
of the profiled steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from memdoctor.capture.session import ProfileSession
from memdoctor.device import FakeDevice


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--timing-steps",
        action="store_true",
        help="profile on a FakeDevice (which has an allocator) so that, as on CUDA, only the first and last "
        "profiled steps are detailed; prints the detailed and the timing steps' medians apart",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = BertConfig(
        hidden_size=32, num_hidden_layers=12, num_attention_heads=2, intermediate_size=64, vocab_size=500
    )
    model = BertForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = torch.randint(1, 500, (2, 16)), torch.randint(0, 2, (2,))

    def step() -> None:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    def run(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1000)
        return times

    def timed(n: int) -> float:
        return statistics.median(run(n))

    for _ in range(3):
        step()
    bare = timed(30)
    if args.timing_steps:
        session = ProfileSession(steps=30, warmup=1, device=FakeDevice())
        session.start()
        times = run(31)
        session.finish()
        detailed = [times[0], times[1], times[30]]
        timing = times[2:30]
        print(
            f"bare {bare:.2f} ms  detailed steps {statistics.median(detailed):.2f} ms "
            f"({statistics.median(detailed) / bare:.2f}x)  timing steps {statistics.median(timing):.2f} ms "
            f"({statistics.median(timing) / bare:.2f}x)"
        )
        return
    session = ProfileSession(steps=60, warmup=1)
    session.start()
    profiled = timed(30)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        timed(10)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    session.finish()
    print(f"bare {bare:.2f} ms  profiled {profiled:.2f} ms  ratio {profiled / bare:.2f}x")


if __name__ == "__main__":
    main()
