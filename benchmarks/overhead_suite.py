"""Profiler overhead side by side (issue 3, point 9): the bare script, memdoctor with the memory ledger
only, memdoctor with every collector, and torch.profiler, on the same steps of the same workloads.

Run on a CUDA machine from the repository root (about 5-8 minutes on an H200):

    python benchmarks/overhead_suite.py --out /tmp/overhead

Workloads (the scripts in benchmarks/workloads/, each run as its own process):
  * ``bert-b32-s512-fp32``: BERT-base, batch 32, padded to 512, fp32 (GPU-bound);
  * ``gpt2-trainer-b8-s512``: GPT-2 small under the Hugging Face Trainer, batch 8, length 512;
  * ``bert-b8-s128-bf16``: BERT-base under bf16 autocast, batch 8, length 128 (launch-bound: ~30 ms a
    step, ~200 module calls a forward, where per-module Python work shows).
Variants, each the command a user would type:
  * ``bare``: ``python SCRIPT ARGS``;
  * ``ledger``: ``memdoctor profile --collect none`` (the memory ledger only);
  * ``all``: ``memdoctor profile --collect all`` (every collector this build has);
  * ``torch_profiler``: ``benchmarks/workloads/under_torch_profiler.py``, torch.profiler with
    profile_memory, record_shapes and with_stack on the same steps.
Every run writes synchronised per-step wall times (the workloads' ``--timing-file``); the figure is the
median over the profiled steps (after ``warmup`` steps; the same step numbers in every variant), and
the ratio is against ``bare``. For memdoctor the detailed steps (the first and last profiled steps,
with the per-module ledger) and the timing steps (between them, optimizer hooks only) are also given
apart, as ``gpu_suite.overhead`` does. ``--smoke`` runs tiny models on the CPU to check the plumbing
(on a CPU every memdoctor step is detailed, so there are no timing steps).

Results: OUT/results.json, and a markdown table on stdout for BENCHMARKS.md; every run's log, timing
file and memdoctor output folder stay under OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BERT = "benchmarks/workloads/bert_story.py"
GPT2 = "benchmarks/workloads/gpt2_trainer.py"
UNDER_PROFILER = "benchmarks/workloads/under_torch_profiler.py"
VARIANTS = ("bare", "ledger", "all", "torch_profiler")
EXTRA_STEPS = 3  # run past the window: the last memdoctor step stops the script, torch.profiler's teardown


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    script: str
    args: tuple[str, ...]
    warmup: int
    steps: int


def workloads(smoke: bool) -> list[Workload]:
    """The three workloads of issue 3 point 9; tiny CPU versions with ``smoke``."""
    if smoke:  # process start-up dominates here: two workloads cover both scripts and the Trainer
        return [
            Workload(
                "bert-tiny-bf16",
                "tiny BERT bf16 b2 s32 (CPU smoke)",
                BERT,
                ("--tiny", "--batch-size", "2", "--seq-len", "32", "--bf16"),
                1,
                3,
            ),
            Workload("gpt2-tiny-trainer", "tiny GPT-2, HF Trainer (CPU smoke)", GPT2, ("--tiny",), 1, 3),
        ]
    return [
        Workload("bert-b32-s512-fp32", "BERT-base b32 s512 fp32 (GPU-bound)", BERT, (), 2, 8),
        Workload("gpt2-trainer-b8-s512", "GPT-2 small, HF Trainer, b8 s512 fp32", GPT2, (), 2, 8),
        Workload(
            "bert-b8-s128-bf16",
            "BERT-base bf16 b8 s128 (launch-bound)",
            BERT,
            ("--batch-size", "8", "--seq-len", "128", "--bf16"),
            2,
            20,
        ),
    ]


# ----------------------------------------------------------------------------------------- running


def command(w: Workload, variant: str, timing: Path, folder: Path) -> list[str]:
    """The command line of one variant: the workload's own arguments, enough steps, a timing file."""
    script_args = [*w.args, "--steps", str(w.warmup + w.steps + EXTRA_STEPS), "--timing-file", str(timing)]
    if variant == "bare":
        return [sys.executable, w.script, *script_args]
    if variant == "torch_profiler":
        window = ["--warmup", str(w.warmup), "--steps", str(w.steps)]
        return [sys.executable, UNDER_PROFILER, *window, w.script, *script_args]
    collect = "none" if variant == "ledger" else "all"
    md = ["--collect", collect, "--warmup", str(w.warmup), "--steps", str(w.steps)]
    md += ["-o", str(folder), "--force"]
    return [sys.executable, "-m", "memdoctor", "profile", *md, w.script, "--", *script_args]


def run(cmd: list[str], log: Path) -> tuple[int, float]:
    """Run one command, its output to ``log``; (exit code, wall seconds)."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    print(f"[{wall:6.1f}s rc={rc}] {' '.join(cmd)}", flush=True)
    return rc, wall


def timing_rows(path: Path) -> dict[int, float]:
    """The workload's timing file: 1-based step -> step_ms (the last line of a step wins)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {int(r["step"]): float(r["step_ms"]) for r in rows}


def measure(w: Workload, variant: str, out: Path, repeat: int) -> dict[str, Any]:
    """Run one variant and take the medians of its window (timing lines warmup+1 .. warmup+steps,
    i.e. the 0-based steps memdoctor profiles)."""
    tag = f"{w.name}.{variant}" + (f".r{repeat}" if repeat else "")
    timing, folder = out / f"{tag}.timing.jsonl", out / tag
    timing.unlink(missing_ok=True)
    cmd = command(w, variant, timing, folder)
    rc, wall = run(cmd, out / f"{tag}.log")
    rows = timing_rows(timing)
    window = range(w.warmup + 1, w.warmup + w.steps + 1)
    res: dict[str, Any] = {"variant": variant, "rc": rc, "wall_s": round(wall, 1), "command": _cmd(cmd)}
    res.update(_medians([rows[s] for s in window if s in rows], "median"))
    if variant in ("ledger", "all"):
        res.update(split_detailed(rows, w, folder))
    return res


def split_detailed(rows: dict[int, float], w: Workload, folder: Path) -> dict[str, Any]:
    """Medians of memdoctor's detailed and timing steps apart, read from its trace (which steps were
    detailed; on a CPU, every one)."""
    detail = detailed_steps(folder / "trace.jsonl.gz")
    detailed, timing = [], []
    for step in range(w.warmup, w.warmup + w.steps):  # memdoctor's 0-based step = timing line - 1
        if step + 1 in rows and step in detail:
            (detailed if detail[step] else timing).append(rows[step + 1])
    return {**_medians(detailed, "detailed"), **_medians(timing, "timing")}


def detailed_steps(trace_path: Path) -> dict[int, bool]:
    """step -> whether memdoctor recorded its per-module ledger (``detail`` ``full``)."""
    if not trace_path.exists():
        return {}
    from memdoctor.trace import load_trace  # the repository's memdoctor (run from the repo root)

    return {s.step: s.detail != "timing" for s in load_trace(trace_path).steps}


def _medians(xs: list[float], key: str) -> dict[str, Any]:
    return {f"{key}_ms": round(statistics.median(xs), 3) if xs else None, f"n_{key}": len(xs)}


def _cmd(cmd: list[str]) -> str:
    return " ".join(["python" if i == 0 else a for i, a in enumerate(cmd)])


def ratios(variants: dict[str, dict[str, Any]]) -> None:
    """Add ``ratio`` (and ``detailed_ratio``, ``timing_ratio``) against the bare run's median."""
    bare = variants.get("bare", {}).get("median_ms")
    for res in variants.values():
        for key in ("median", "detailed", "timing"):
            value = res.get(f"{key}_ms")
            name = "ratio" if key == "median" else f"{key}_ratio"
            if f"{key}_ms" in res:
                res[name] = round(value / bare, 3) if value is not None and bare else None


# ----------------------------------------------------------------------------------------- output


def fmt_ratio(res: dict[str, Any], key: str = "ratio") -> str:
    value = res.get(key)
    return "n/a" if value is None else f"{value:.2f}×"


def fmt_memdoctor(res: dict[str, Any]) -> str:
    """``1.02× (detailed 1.31×, timing 1.00×)``; a CPU run has no timing steps."""
    parts = [f"detailed {fmt_ratio(res, 'detailed_ratio')}"]
    if res.get("n_timing"):
        parts.append(f"timing {fmt_ratio(res, 'timing_ratio')}")
    return f"{fmt_ratio(res)} ({', '.join(parts)})"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| workload | bare step | memdoctor, ledger only | memdoctor, all collectors | torch.profiler |",
        "|---|---:|---:|---:|---:|",
    ]
    for wl in results["workloads"]:
        v = wl["variants"]
        bare = v["bare"].get("median_ms")
        bare_txt = "n/a" if bare is None else f"{bare:.1f} ms"
        lines.append(
            f"| {wl['label']} ({wl['warmup']} warm-up + {wl['steps']} steps) | {bare_txt} "
            f"| {fmt_memdoctor(v['ledger'])} | {fmt_memdoctor(v['all'])} "
            f"| {fmt_ratio(v['torch_profiler'])} |"
        )
    lines += [
        "",
        "Step time: median of synchronised per-step wall times over the profiled steps; × is against the "
        "bare script. memdoctor's detailed steps (first and last profiled step, with the per-module "
        "ledger) and timing steps (optimizer hooks only) in brackets.",
        f"Command: `{results['command']}` ({results['device']}, torch {results['torch']}).",
    ]
    return "\n".join(lines)


def environment() -> dict[str, str]:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU {platform.machine()}"
    return {"device": device, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the plumbing")
    ap.add_argument("--only", default=None, help="comma list of workload names (default: all three)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant (their medians are listed)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.smoke:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the smoke run is the CPU path, everywhere
    chosen = [w for w in workloads(args.smoke) if args.only is None or w.name in args.only.split(",")]
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    results: dict[str, Any] = {
        "command": "python benchmarks/overhead_suite.py " + " ".join(argv or sys.argv[1:]),
        **environment(),
        "workloads": [],
    }
    for w in chosen:
        runs = {v: [measure(w, v, args.out, r) for r in range(args.repeat)] for v in variants}
        per_variant = {v: _best_of(rs) for v, rs in runs.items()}
        ratios(per_variant)
        entry = {"name": w.name, "label": w.label, "warmup": w.warmup, "steps": w.steps}
        entry.update(script=w.script, args=list(w.args), variants=per_variant, runs=runs)
        results["workloads"].append(entry)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    if set(variants) == set(VARIANTS):
        print("\n" + markdown(results))
    print(f"\nWrote {args.out / 'results.json'}")
    failed = [r for wl in results["workloads"] for rs in wl["runs"].values() for r in rs if r["rc"] != 0]
    return 1 if failed else 0


def _best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures stand for the variant: with repeats, the run with the median step time."""
    ok = [r for r in runs if r.get("median_ms") is not None] or runs
    ok = sorted(ok, key=lambda r: r.get("median_ms") or 0.0)
    return dict(ok[len(ok) // 2])


if __name__ == "__main__":
    sys.exit(main())
