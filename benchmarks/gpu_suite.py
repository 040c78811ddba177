"""The GPU benchmark suite behind BENCHMARKS.md: ledger accuracy, overhead, and the recorded traces.

Run on a CUDA machine from the repository root:

    python benchmarks/gpu_suite.py --out /tmp/gpu-suite

It runs, each as its own process, exactly what a user would type:
  * accuracy: `memdoctor profile` on BERT-base (batch 32, padded to 512, fp32, AdamW; sdpa and eager
    attention) and GPT-2 small with the HF Trainer; the ledger's accounted categories at the peak are
    compared with `torch.cuda.max_memory_allocated()` (the step's allocator peak);
  * recorded traces: the story's BERT-base under `--budget 8GiB` (it runs out of memory) and a
    configuration that fits 8 GiB;
  * overhead: the same workload bare and under `memdoctor profile`, each timing its own steps
    (synchronised wall time per step, written by the workload's `--timing-file`), median of the steps
    after warm-up: BERT-base fp32 batch 32 (GPU-bound) and BERT-base bf16 batch 8 sequence 128
    (launch-bound).
Results go to OUT/results.json and a table on stdout; every run's folder (trace, report, summary) stays
under OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BERT = "benchmarks/workloads/bert_story.py"
GPT2 = "benchmarks/workloads/gpt2_trainer.py"


def sh(cmd: list[str], log: Path) -> int:
    t = time.time()
    with log.open("w") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    print(f"[{time.time() - t:6.1f}s rc={rc}] {' '.join(cmd)}", flush=True)
    return rc


def profile(out: Path, name: str, script: str, args: list[str], extra: list[str] = ()) -> dict:
    folder = out / name
    cmd = [
        sys.executable,
        "-m",
        "memdoctor",
        "profile",
        *extra,
        "-o",
        str(folder),
        "--force",
        script,
        "--",
        *args,
    ]
    rc = sh(cmd, out / f"{name}.log")
    summary = folder / "summary.json"
    res = {"name": name, "rc": rc, "command": "memdoctor profile " + " ".join(cmd[4:])}
    if summary.exists():
        s = json.loads(summary.read_text())
        res.update(
            peak=s.get("peak_memory_bytes"),
            categories=s.get("categories"),
            accounted_fraction=s.get("accounted_fraction"),
            status=s.get("status"),
            steps=s.get("steps_profiled"),
        )
    return res


def step_times(path: Path, skip: int) -> list[float]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step_ms"] for r in rows[skip:]]


def overhead(out: Path, name: str, args: list[str], steps: int, md_args: list[str] = ()) -> dict:
    bare_file, prof_file = out / f"{name}.bare.jsonl", out / f"{name}.prof.jsonl"
    for f in (bare_file, prof_file):
        f.unlink(missing_ok=True)
    sh(
        [sys.executable, BERT, *args, "--steps", str(steps + 3), "--timing-file", str(bare_file)],
        out / f"{name}.bare.log",
    )
    profile(
        out,
        name,
        BERT,
        [*args, "--steps", str(steps + 10), "--timing-file", str(prof_file)],
        ["--warmup", "2", "--steps", str(steps), *md_args],
    )
    bare, prof = step_times(bare_file, 3), step_times(prof_file, 3)
    res = {
        "name": name,
        "memdoctor_args": list(md_args),
        "bare_ms": _median(bare),
        "profiled_ms": _median(prof),
        "n_bare": len(bare),
        "n_prof": len(prof),
    }
    if bare and prof:
        res["ratio"] = res["profiled_ms"] / res["bare_ms"]
    # memdoctor step k is the workload's timing line k+1. With --detail auto on CUDA the warm-up, first
    # and last profiled steps carry the ledger (detailed); the others are timing steps.
    warmup = 2
    detailed = set(range(warmup)) | {warmup, warmup + steps - 1}
    rows = _rows(prof_file)
    full = [r["step_ms"] for r in rows if r["step"] - 1 in detailed and r["step"] > 3]
    timing = [r["step_ms"] for r in rows if r["step"] - 1 not in detailed and 3 < r["step"] <= warmup + steps]
    res.update(detailed_ms=_median(full), timing_ms=_median(timing))
    if bare and full:
        res["detailed_ratio"] = res["detailed_ms"] / res["bare_ms"]
    if bare and timing:
        res["timing_ratio"] = res["timing_ms"] / res["bare_ms"]
    return res


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="accuracy,traces,overhead")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each overhead pair")
    ap.add_argument(
        "--collect",
        default="none",
        help="memdoctor's --collect for the overhead runs: none (memory ledger only), all, or a list; "
        "a comma-free list of several settings separated by '+' runs each (e.g. none+all)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    only = set(args.only.split(","))
    results: dict[str, list[dict]] = {"accuracy": [], "traces": [], "overhead": []}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))

    def add(section: str, *items: dict) -> None:
        """Record runs and rewrite the results, so that a suite cut short keeps what it measured."""
        results[section].extend(items)
        save()

    if "accuracy" in only:
        add(
            "accuracy",
            profile(args.out, "bert-b32-s512-fp32-sdpa", BERT, ["--steps", "20"]),
            profile(args.out, "bert-b32-s512-fp32-eager", BERT, ["--steps", "20", "--attn", "eager"]),
            profile(args.out, "gpt2-small-trainer-b8-s512", GPT2, ["--steps", "20"]),
        )
    if "traces" in only:
        add(
            "traces",
            profile(
                args.out,
                "bert-b32-s512-8gib-oom",
                BERT,
                ["--steps", "20", "--attn", "eager"],
                ["--budget", "8GiB"],
            ),
            profile(
                args.out,
                "bert-b8-s128-8gib",
                BERT,
                ["--steps", "20", "--batch-size", "8", "--seq-len", "128"],
                ["--budget", "8GiB"],
            ),
        )
    launch = ["--batch-size", "8", "--seq-len", "128", "--bf16"]
    if "overhead" in only:
        for collect in args.collect.split("+"):
            md = ["--collect", collect]
            for r in range(args.repeat):
                tag = f"{collect.replace(',', '-')}-r{r}"
                add(
                    "overhead",
                    overhead(args.out, f"overhead-bert-b32-s512-fp32-{tag}", [], 8, md),
                    overhead(args.out, f"overhead-bert-b8-s128-bf16-{tag}", launch, 20, md),
                )
    if "depth1" in only:
        add(
            "overhead",
            overhead(
                args.out,
                "overhead-bert-b8-s128-bf16-depth1",
                launch,
                20,
                ["--collect", "none", "--time-depth", "1"],
            ),
        )
    save()
    print(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
