"""In-process probe of the ledger on a GPU: hook micro-costs, ledger-vs-allocator accuracy, overhead.

Run on the device:  python benchmarks/gpu_probe.py --out $OUT/probe.json
Each workload runs bare (timed per step, synchronised) and under a ProfileSession in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def micro_costs() -> dict[str, float]:
    n = 2000
    out = {}
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        torch.cuda.memory_stats()
    out["memory_stats_us"] = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        torch.cuda.memory_allocated()
    out["memory_allocated_us"] = (time.perf_counter() - t) / n * 1e6
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    t = time.perf_counter()
    for e in evs:
        e.record()
    out["event_record_us"] = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return out


def bert(batch: int, seq: int, attn: str):
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(num_labels=2, attn_implementation=attn)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    ids = torch.randint(1, 30000, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (batch,), device="cuda")

    def step(amp: bool) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def gpt2(batch: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    ids = torch.randint(1, 50000, (batch, seq), device="cuda")

    def step(amp: bool) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def timed(step, amp: bool, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(amp)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return times


def run(name: str, build, amp: bool, n: int = 8, depth: int | None = None) -> dict:
    from memdoctor.capture.session import ProfileSession

    model, opt, step = build()
    timed(step, amp, 3)  # warm up, optimizer state created
    torch.cuda.reset_peak_memory_stats()
    bare = timed(step, amp, n)
    bare_peak = torch.cuda.max_memory_allocated()
    records: list[dict] = []
    sess = ProfileSession(steps=n, warmup=1, sink=records.append, time_depth=depth)
    sess.start()
    prof = timed(step, amp, n + 2)
    sess.finish()
    bare2 = timed(step, amp, n)
    steps = [r for r in records if r["type"] == "step" and not r["warmup"] and r["complete"]]
    mem = steps[-1]["memory"] if steps else {}
    peak = mem.get("peak_bytes")
    res = {
        "name": name,
        "bare_ms": statistics.median(bare + bare2),
        "profiled_ms": statistics.median(prof[2:]),
        "bare_peak": bare_peak,
        "ledger_peak": peak,
        "accounted": mem.get("accounted_bytes"),
        "categories": mem.get("categories_at_peak"),
        "peak_phase": mem.get("peak_phase"),
        "peak_module": mem.get("peak_module"),
        "samples": len(steps[-1]["timeline"]["t_ms"]) if steps else 0,
        "time_depth": sess.time_depth,
        "n_steps": len(steps),
    }
    res["ratio"] = res["profiled_ms"] / res["bare_ms"]
    if peak:
        res["accounted_fraction"] = mem["accounted_bytes"] / peak
    del model, opt, step
    torch.cuda.empty_cache()
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--depth", type=int, default=None)
    args = ap.parse_args()
    results = {"micro": micro_costs()}
    print(json.dumps(results["micro"]), flush=True)
    results["runs"] = [
        run("bert-b32-s512-fp32-eager", lambda: bert(32, 512, "eager"), False, depth=args.depth),
        run("bert-b32-s512-fp32-sdpa", lambda: bert(32, 512, "sdpa"), False, depth=args.depth),
        run("bert-b8-s128-bf16-sdpa", lambda: bert(8, 128, "sdpa"), True, n=20, depth=args.depth),
        run("bert-b8-s128-bf16-sdpa-d1", lambda: bert(8, 128, "sdpa"), True, n=20, depth=1),
        run("bert-b8-s128-bf16-sdpa-all", lambda: bert(8, 128, "sdpa"), True, n=20, depth=99),
        run("gpt2-b8-s512-fp32", lambda: gpt2(8, 512), False, depth=args.depth),
    ]
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
