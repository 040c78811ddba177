"""Where does a timing step's overhead go? In one process, alternate the launch-bound BERT-base step
(bf16, batch 8, sequence 128) bare and under ProfileSession variants, so machine noise hits all alike.

    python benchmarks/diag_timing_steps.py [--rounds 3] [--steps 15]

Prints the median step time per variant, then a cProfile of memdoctor's functions over timing steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from bert_story import build_config, parse_args
from transformers import BertForSequenceClassification

from memdoctor.capture.session import ProfileSession
from memdoctor.device import default_device


def micro(dev: torch.device) -> None:
    """Host time of each device call a timing step makes, 500 calls each."""
    if dev.type != "cuda":
        return
    device = default_device()
    ev = device.marker()
    calls = {
        "device.memory()": device.memory,
        "torch.cuda.memory_stats()": torch.cuda.memory_stats,
        "device.allocator_counters()": device.allocator_counters,
        "device.marker()": device.marker,
        "device.ready(marker)": lambda: device.ready(ev),
        "device.reset_peak()": device.reset_peak,
    }
    for name, fn in calls.items():
        fn()
        t = time.perf_counter()
        for _ in range(500):
            fn()
        print(f"{name:30s} {(time.perf_counter() - t) / 500 * 1e6:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    args = parse_args(["--batch-size", "8", "--seq-len", "128", "--bf16", *(["--tiny"] if a.tiny else [])])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = BertForSequenceClassification(build_config(args)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = {
        "input_ids": torch.randint(0, 1000, (args.batch_size, args.seq_len), device=dev),
        "attention_mask": torch.ones(args.batch_size, args.seq_len, dtype=torch.long, device=dev),
        "labels": torch.zeros(args.batch_size, dtype=torch.long, device=dev),
    }

    def steps(n: int, session: ProfileSession | None = None) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1000)
        return out

    def run(variant: str, n: int) -> list[float]:
        if variant == "bare":
            return steps(n)[3:]
        device = default_device()
        s = ProfileSession(steps=10**6, warmup=1, device=device)
        if variant == "no_grad_hooks":
            s._watch_grads = lambda model: None  # type: ignore[method-assign]
        if variant == "no_mem_reads":
            device.memory = lambda: None  # type: ignore[method-assign]
        if variant == "no_counters":
            device.allocator_counters = lambda: None  # type: ignore[method-assign]
        if variant == "no_records":
            s.sink = lambda rec: None
            s._emit_ready = lambda wait: s._pending.clear()  # type: ignore[method-assign]
        s.start()
        try:
            return steps(n, s)[3:]  # steps 0-1 are detailed, 2.. timing
        finally:
            s.stop()

    micro(dev)
    variants = ["bare", "session", "no_mem_reads", "no_counters", "no_records"]
    steps(5)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            times[v] += run(v, a.steps)
    base = statistics.median(times["bare"])
    for v in variants:
        m = statistics.median(times[v])
        print(f"{v:15s} median {m:7.2f} ms  x{m / base:.3f}  (n={len(times[v])})")
    s = ProfileSession(steps=10**6, warmup=1, device=default_device())
    s.start()
    steps(4, s)
    prof = cProfile.Profile()
    prof.enable()
    steps(10, s)
    prof.disable()
    s.stop()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
