"""The story's scenario, measured (issue 5, point 6): memdoctor's plan against the best hand-tuned config.

``--workload`` picks the scenario (default ``story``, described first; the other two below).

BERT-base sequence classification, batch 32, every sequence padded to 512, fp32, AdamW, a plain loop
(``benchmarks/workloads/bert_story.py``), under an 8 GiB cap on a larger GPU:

(a) the script as it is: expected to run out of memory;
(b) ``memdoctor profile --budget 8GiB`` (with ``--verify`` when asked), then
    ``memdoctor run --config OUT/profile/memdoctor.yaml`` on the unmodified script: its samples/s;
(c) a small hand grid of the story's levers, each run bare through the workload's own flags
    (checkpoint every layer / every 2nd, micro-batch 16 or 8 with accumulation to 32, bf16, trimmed
    padding): their samples/s; a config that runs out of memory does not count.

It prints a table and writes OUT/results.json: memdoctor's samples/s against the best hand config
(target: at least 90%), and against the best hand config that keeps fp32 numerics (memdoctor's planner
tries numerics-preserving levers first; bf16 changes the numbers the model computes).

Every run is its own process under a timeout and gets the same cap: the bare runs through the
workload's ``--memory-cap-gib`` (``torch.cuda.set_per_process_memory_fraction``, as ``memdoctor
profile --budget`` caps: ``memdoctor.device.CudaDevice.apply_cap``). Steps are few (12; samples/s from
the median of the last 8 step times of the workload's ``--timing-file``), so the whole run takes a few
minutes on an H200 (the lead runs it on the device):

    python benchmarks/story_scenario.py --out /tmp/story [--verify]

``--tiny`` is a CPU smoke run (a 2-layer BERT, 4 steps, two grid points, a small budget so that there is
a plan); its figures mean nothing.

The same for the two framework-driven loops of point 6, each under the same cap, with its own hand grid
through the script's own flags (``WORKLOADS`` below):

- ``--workload gpt2-trainer``: GPT-2 small with the HF ``Trainer`` (``workloads/gpt2_trainer.py``),
  effective batch 16, sequences of 512 (packed full-length: no padding lever), fp32, the Trainer's AdamW;
  levers: ``gradient_checkpointing``, micro-batch 8 × 2 / 4 × 4 (``gradient_accumulation_steps``), bf16.
- ``--workload vit-lightning``: ViT-base/16 in a ``LightningModule`` (``workloads/vit_lightning.py``),
  batch 64 of 224×224 images, 10 classes, ``precision="32-true"``, AdamW; levers: the HF model's own
  gradient checkpointing, ``accumulate_grad_batches`` 2 / 4, ``precision="bf16-mixed"``.

samples/s is always the effective batch × 1000 / step ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKLOADS_DIR = REPO / "benchmarks" / "workloads"
TARGET = 0.90
LAST_STEPS = 8  # samples/s from the median of the last LAST_STEPS step times
# models are built from configs; a download attempt fails at once instead of waiting on a network
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# name -> the workload's flags; (c)'s hand grid. Every entry keeps the effective batch of 32.
GRID: dict[str, list[str]] = {
    "checkpoint every layer": ["--checkpoint-every", "1"],
    "checkpoint every 2nd layer": ["--checkpoint-every", "2"],
    "micro-batch 16 x2": ["--micro-batch", "16"],
    "micro-batch 8 x4": ["--micro-batch", "8"],
    "checkpoint every 2nd, micro-batch 16 x2": ["--checkpoint-every", "2", "--micro-batch", "16"],
    "trim padding, micro-batch 16 x2": ["--trim-padding", "--micro-batch", "16"],
    "trim padding, checkpoint every 2nd": ["--trim-padding", "--checkpoint-every", "2"],
    "bf16": ["--bf16"],
    "bf16, micro-batch 16 x2": ["--bf16", "--micro-batch", "16"],
    "bf16, checkpoint every 2nd": ["--bf16", "--checkpoint-every", "2"],
    "bf16, trim padding": ["--bf16", "--trim-padding"],
    "bf16, checkpoint every 3rd": ["--bf16", "--checkpoint-every", "3"],
    "bf16, checkpoint every 4th": ["--bf16", "--checkpoint-every", "4"],
    "bf16, trim padding, micro-batch 16 x2": ["--bf16", "--trim-padding", "--micro-batch", "16"],
}
TINY_GRID = ("checkpoint every layer", "trim padding, checkpoint every 2nd")

# GPT-2 small, HF Trainer: the scenario passes --batch-size 16 (the workload's default is 8); a grid entry's
# later --batch-size wins (argparse), and batch-size x grad-accum stays 16.
GPT2_GRID: dict[str, list[str]] = {
    "gradient checkpointing": ["--gradient-checkpointing"],
    "micro-batch 8 x2": ["--batch-size", "8", "--grad-accum", "2"],
    "micro-batch 4 x4": ["--batch-size", "4", "--grad-accum", "4"],
    "gradient checkpointing, micro-batch 8 x2": [
        "--gradient-checkpointing",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
    ],
    "bf16": ["--bf16"],
    "bf16, micro-batch 8 x2": ["--bf16", "--batch-size", "8", "--grad-accum", "2"],
    "bf16, gradient checkpointing": ["--bf16", "--gradient-checkpointing"],
}

# ViT-base/16, Lightning: --accumulate N loads batches of 64/N and accumulates N of them (the batch stays 64).
VIT_GRID: dict[str, list[str]] = {
    "gradient checkpointing": ["--gradient-checkpointing"],
    "accumulate 2 (32 x2)": ["--accumulate", "2"],
    "accumulate 4 (16 x4)": ["--accumulate", "4"],
    "gradient checkpointing, accumulate 2": ["--gradient-checkpointing", "--accumulate", "2"],
    "bf16-mixed": ["--precision", "bf16-mixed"],
    "bf16-mixed, accumulate 2": ["--precision", "bf16-mixed", "--accumulate", "2"],
    "bf16-mixed, gradient checkpointing": ["--precision", "bf16-mixed", "--gradient-checkpointing"],
}


# ResNet-50 b128, plain loop (issue 15): --micro-batch M splits each batch of 128 inside the loop.
RESNET_GRID: dict[str, list[str]] = {
    "micro-batch 64 x2": ["--micro-batch", "64"],
    "checkpoint stages": ["--checkpoint-stages"],
    "bf16": ["--bf16"],
    "bf16, channels last": ["--bf16", "--channels-last"],
    "bf16, micro-batch 64 x2": ["--bf16", "--micro-batch", "64"],
    "bf16, channels last, micro-batch 64 x2": ["--bf16", "--channels-last", "--micro-batch", "64"],
    "bf16, checkpoint stages": ["--bf16", "--checkpoint-stages"],
}

# The minimal GPT trainer (issue 15), batch 12 x 1024 under its own bf16 autocast: the scenario passes
# --batch-size 12; a grid entry's later --batch-size wins, and batch-size x grad-accum stays 12.
MINI_GPT_GRID: dict[str, list[str]] = {
    "micro-batch 6 x2": ["--batch-size", "6", "--grad-accum", "2"],
    "micro-batch 4 x3": ["--batch-size", "4", "--grad-accum", "3"],
    "micro-batch 3 x4": ["--batch-size", "3", "--grad-accum", "4"],
    "checkpoint every block": ["--checkpoint"],
    "checkpoint every block, micro-batch 6 x2": ["--checkpoint", "--batch-size", "6", "--grad-accum", "2"],
}


@dataclass(frozen=True)
class Workload:
    """One scenario: its script, the batch every run keeps, its hand grid, and how a tiny run differs."""

    script: str  # under benchmarks/workloads
    batch: int  # the effective batch: of the run as is, of every grid entry, of memdoctor's plan
    grid: dict[str, list[str]]
    tiny_grid: tuple[str, ...]  # CPU smoke: a couple of GRID entries
    tiny_batch: int
    tiny_budget: str  # small enough that the tiny model needs a plan memdoctor run can apply
    args: tuple[str, ...] = ()  # the scenario's own script arguments (the same in every run)
    tiny_args: tuple[str, ...] = ("--tiny", "--device", "cpu")
    low_precision: tuple[str, ...] = ("--bf16", "--fp16")  # a flag (or value) that leaves fp32 numerics

    @property
    def path(self) -> Path:
        return WORKLOADS_DIR / self.script

    def fp32(self, flags: list[str]) -> bool:
        return not any(f in self.low_precision for f in flags)


WORKLOADS: dict[str, Workload] = {
    # the tiny story peaks at ~4.9 MB (CPU accounting): 4 MiB plans micro-batch 1 x4 (3 MiB adds an
    # optimizer offload, which memdoctor run does not apply yet)
    "story": Workload("bert_story.py", 32, GRID, TINY_GRID, tiny_batch=4, tiny_budget="4MiB"),
    "gpt2-trainer": Workload(
        "gpt2_trainer.py",
        16,
        GPT2_GRID,
        ("gradient checkpointing, micro-batch 8 x2", "bf16"),
        tiny_batch=16,  # cheap for the tiny model, and the grid's flags then fit as they are
        tiny_budget="12MiB",  # the tiny run peaks at ~25 MB (CPU accounting): micro-batch 4 x4
        args=("--batch-size", "16"),
        tiny_args=("--tiny",),  # the Trainer picks its device
    ),
    "vit-lightning": Workload(
        "vit_lightning.py",
        64,
        VIT_GRID,
        ("gradient checkpointing, accumulate 2", "bf16-mixed"),
        tiny_batch=16,
        tiny_budget="3MiB",  # the tiny run peaks at ~3.3 MB (CPU accounting): micro-batch 8 x2
        tiny_args=("--tiny", "--device", "cpu", "--batch-size", "16"),
        low_precision=("bf16-mixed", "16-mixed", "bf16-true", "16-true"),
    ),
    "resnet-loop": Workload(
        "resnet_loop.py",
        128,
        RESNET_GRID,
        ("checkpoint stages", "bf16"),
        tiny_batch=8,
        tiny_budget="20MiB",
        tiny_args=("--tiny", "--device", "cpu"),
    ),
    "mini-gpt": Workload(
        "mini_gpt.py",
        12,
        MINI_GPT_GRID,
        ("checkpoint every block",),
        tiny_batch=4,
        tiny_budget="2MiB",
        args=("--batch-size", "12"),
        tiny_args=("--tiny", "--device", "cpu", "--batch-size", "4"),
        low_precision=(),  # the script's own bf16 autocast in every run: the numerics are the same
    ),
}


@dataclass
class Run:
    """One process: what ran, how it ended, and what it measured."""

    name: str
    kind: str  # "bare", "memdoctor", "hand"
    command: list[str]
    status: str = "not run"  # ok, oom, failed, timeout, skipped
    note: str = ""
    samples_per_s: float | None = None
    step_ms: float | None = None
    max_reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    wall_s: float = 0.0
    fp32: bool = True
    steps_ms: list[float] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    runs = [bare(args)]
    if args.first_shot and not args.hand_only:  # the plan without --verify, then the verified one
        runs += memdoctor_runs(args, verify=False, tag="b-first")
    runs += [] if args.hand_only else memdoctor_runs(args, verify=args.verify or args.first_shot)
    spec = workload(args)
    names = args.grid or (spec.tiny_grid if args.tiny else tuple(spec.grid))
    runs += [hand(args, name) for name in names]
    result = summarize(args, runs)
    print_table(runs, result)
    (out / "results.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"Wrote {out / 'results.json'}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workload", choices=list(WORKLOADS), default="story", help="the scenario (default story)"
    )
    p.add_argument("--out", type=Path, default=None, help="default ./story-scenario (./WORKLOAD-scenario)")
    p.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: tiny model, few steps, two grid points"
    )
    p.add_argument("--cap-gib", type=float, default=8.0, help="the card to emulate (default 8 GiB)")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default 12; 4 with --tiny)"
    )
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run (default 150)")
    p.add_argument("--verify", action="store_true", help="profile with --verify in (b)")
    p.add_argument("--hand-only", action="store_true", help="skip (b): the run as is and the hand grid only")
    p.add_argument(
        "--first-shot",
        action="store_true",
        help="(b) twice: the plan without --verify (first shot), then with it; their throughput ratio",
    )
    p.add_argument(
        "--grid", default=None, help="the workload's grid entries to run, separated by ; (default: all)"
    )
    args = p.parse_args(argv)
    grid = workload(args).grid
    args.grid = tuple(n.strip() for n in (args.grid or "").split(";") if n.strip()) or None
    unknown = [n for n in args.grid or () if n not in grid]
    if unknown:
        p.error(f"--grid: unknown {', '.join(unknown)}; known for {args.workload}: {', '.join(grid)}")
    if args.out is None:
        args.out = Path("story-scenario" if args.workload == "story" else f"{args.workload}-scenario")
    if args.steps is None:
        args.steps = 4 if args.tiny else 12
    return args


# ----------------------------------------------------------------------------------------- the runs


def workload(args: argparse.Namespace) -> Workload:
    return WORKLOADS[args.workload]


def workload_args(args: argparse.Namespace, run_dir: Path, *, cap: bool = True, steps: int = 0) -> list[str]:
    """The workload's own arguments: size, steps, the cap (unless memdoctor applies it), timing, peak."""
    spec = workload(args)
    out = [*spec.args, "--steps", str(steps or args.steps), "--timing-file", str(run_dir / "steps.jsonl")]
    out += ["--peak-file", str(run_dir / "peak.json")]
    if args.tiny:
        out += spec.tiny_args
    if cap:
        out += ["--memory-cap-gib", str(args.cap_gib)]
    return out


def batch_size(args: argparse.Namespace) -> int:
    """The workload's effective batch (story: 32, 4 with --tiny); every grid point keeps it."""
    spec = workload(args)
    return spec.tiny_batch if args.tiny else spec.batch


def budget(args: argparse.Namespace) -> str:
    """memdoctor's --budget: the cap; with --tiny a budget small enough that the tiny model needs a plan."""
    return workload(args).tiny_budget if args.tiny else f"{args.cap_gib:g}GiB"


def script(args: argparse.Namespace) -> str:
    return str(workload(args).path)


def bare(args: argparse.Namespace) -> Run:
    d = run_dir(args, "a-bare")
    name = "as is (the story's run)" if args.workload == "story" else "as is"
    run = Run(name, "bare", [sys.executable, script(args), *workload_args(args, d)])
    return execute(run, args, d)


def hand(args: argparse.Namespace, name: str) -> Run:
    d = run_dir(args, "c-" + slug(name))
    spec = workload(args)
    flags = spec.grid[name]
    run = Run(name, "hand", [sys.executable, script(args), *workload_args(args, d), *flags])
    run.fp32 = spec.fp32(flags)
    return execute(run, args, d)


def memdoctor_runs(args: argparse.Namespace, *, verify: bool, tag: str = "b") -> list[Run]:
    """(b): profile under the budget (its own step times are not throughput), then ``memdoctor run``.
    ``tag`` names the folders (``b-profile``, ``b-run``; ``b-first-...`` for the first shot)."""
    first = tag != "b"
    d = run_dir(args, f"{tag}-profile")
    profile = [
        sys.executable,
        "-m",
        "memdoctor",
        "profile",
        "--budget",
        budget(args),
        "-o",
        str(d / "report"),
    ]
    profile += ["--force", "--warmup", "1", "--steps", "3", *(["--verify"] if verify else [])]
    # memdoctor caps the profiled process itself; the script runs longer than the 4 profiled steps
    script_args = workload_args(args, d, cap=False, steps=max(args.steps, 6))
    name = "memdoctor profile" + (" (first shot)" if first else " --verify" if verify else "")
    prof = execute(Run(name, "profile", [*profile, script(args), "--", *script_args]), args, d)
    config = d / "report" / "memdoctor.yaml"
    kind = "first-shot" if first else "memdoctor"
    if not config.exists():
        prof.note = "no memdoctor.yaml: the profile made no plan (see its report)"
        return [prof, Run("memdoctor run --config", kind, [], status="skipped", note=prof.note)]
    if not has_run_command():
        note = "this memdoctor has no `memdoctor run` (not merged yet)"
        return [prof, Run("memdoctor run --config", kind, [], status="skipped", note=note)]
    d2 = run_dir(args, f"{tag}-run")
    cmd = [sys.executable, "-m", "memdoctor", "run", "--config", str(config), script(args), "--"]
    label = "memdoctor run --config" + (" (first shot)" if first else "")
    run = execute(Run(label, kind, [*cmd, *workload_args(args, d2)]), args, d2)
    run.fp32 = "precision: fp32" in config.read_text() or "precision:" not in config.read_text()
    return [prof, run]


def has_run_command() -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "memdoctor", "run", "--help"], capture_output=True, text=True, timeout=120
    )
    return proc.returncode == 0


def run_dir(args: argparse.Namespace, name: str) -> Path:
    d = args.out / name
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.jsonl", "peak.json"):
        (d / stale).unlink(missing_ok=True)
    return d


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def execute(run: Run, args: argparse.Namespace, d: Path) -> Run:
    """Run one process under the timeout; read its timing and peak files."""
    print(f"[{args.workload}] {run.name} ...", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            run.command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, env=OFFLINE
        )
        (d / "output.txt").write_text(proc.stdout + proc.stderr)
        oom = "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr
        run.status = "ok" if proc.returncode == 0 else ("oom" if oom else "failed")
        if run.status == "failed":
            run.note = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    except subprocess.TimeoutExpired:
        run.status = "timeout"
    run.wall_s = round(time.monotonic() - start, 1)
    read_measurements(run, args, d)
    return run


def read_measurements(run: Run, args: argparse.Namespace, d: Path) -> None:
    timing, peak = d / "steps.jsonl", d / "peak.json"
    if timing.exists():
        rows = [json.loads(line) for line in timing.read_text().splitlines() if line.strip()]
        run.steps_ms = [float(r["step_ms"]) for r in rows]
    if peak.exists():
        p = json.loads(peak.read_text())
        run.max_reserved_bytes = p.get("max_reserved_bytes")
        run.max_allocated_bytes = p.get("max_allocated_bytes")
        if p.get("oom"):
            run.status = "oom"
    last = run.steps_ms[1:][-LAST_STEPS:]  # step 1 includes start-up
    if run.status == "ok" and run.kind != "profile" and last:
        run.step_ms = statistics.median(last)
        run.samples_per_s = round(batch_size(args) * 1000.0 / run.step_ms, 2)


# ----------------------------------------------------------------------------------------- results


def summarize(args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    hand_ok = [r for r in runs if r.kind == "hand" and r.samples_per_s]
    best = max(hand_ok, key=lambda r: r.samples_per_s or 0, default=None)
    best32 = max((r for r in hand_ok if r.fp32), key=lambda r: r.samples_per_s or 0, default=None)
    ours = next((r for r in runs if r.kind == "memdoctor"), None)
    mine = ours.samples_per_s if ours else None
    first = next((r for r in runs if r.kind == "first-shot"), None)
    return {
        "workload": args.workload,
        "batch": batch_size(args),
        "cap_gib": args.cap_gib,
        "steps": args.steps,
        "tiny": args.tiny,
        "target": TARGET,
        "runs": [asdict(r) for r in runs],
        "plan": read_plan(args),
        "memdoctor_samples_per_s": mine,
        "best_hand": best.name if best else None,
        "best_hand_samples_per_s": best.samples_per_s if best else None,
        "best_hand_fp32": best32.name if best32 else None,
        "best_hand_fp32_samples_per_s": best32.samples_per_s if best32 else None,
        "ratio": ratio(mine, best),
        "ratio_fp32": ratio(mine, best32),
        "bare_ooms": next((r.status == "oom" for r in runs if r.kind == "bare"), None),
        "first_shot_plan": read_plan(args, "b-first") if first else None,
        "first_shot_samples_per_s": first.samples_per_s if first else None,
        "first_shot_ratio": ratio(first.samples_per_s, ours) if first else None,
        "memory_error": memory_error(read_plan(args), ours),
        "first_shot_memory_error": memory_error(read_plan(args, "b-first"), first) if first else None,
    }


def memory_error(plan: dict[str, Any] | None, run: Run | None) -> float | None:
    """The run's measured reserved peak against the plan's prediction (+: more than predicted)."""
    predicted = ((plan or {}).get("plan") or {}).get("predicted_reserved_bytes")
    if not predicted or run is None or not run.max_reserved_bytes:
        return None
    return round(run.max_reserved_bytes / predicted - 1.0, 4)


def ratio(mine: float | None, best: Run | None) -> float | None:  # mine over best's samples/s
    if not mine or best is None or not best.samples_per_s:
        return None
    return round(mine / best.samples_per_s, 3)


def read_plan(args: argparse.Namespace, tag: str = "b") -> dict[str, Any] | None:
    path = args.out / f"{tag}-profile" / "report" / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    plan = summary.get("plan") or {}
    keys = ("levers", "config", "predicted_reserved_bytes", "predicted_step_time_ratio", "fits")
    return {"plan": {k: plan.get(k) for k in keys}, "verified": summary.get("verified")}


def print_table(runs: list[Run], result: dict[str, Any]) -> None:
    print(f"\n{'run':44} {'status':8} {'samples/s':>10} {'step ms':>9} {'peak reserved':>14} {'wall s':>7}")
    for r in runs:
        peak = f"{r.max_reserved_bytes / 1024**3:.2f} GiB" if r.max_reserved_bytes else "-"
        sps = f"{r.samples_per_s:.1f}" if r.samples_per_s else "-"
        step = f"{r.step_ms:.1f}" if r.step_ms else "-"
        print(f"{r.name[:44]:44} {r.status:8} {sps:>10} {step:>9} {peak:>14} {r.wall_s:>7.1f}  {r.note}")
    for key in ("ratio", "ratio_fp32"):
        value = result[key]
        best = result["best_hand" if key == "ratio" else "best_hand_fp32"]
        shown = "n/a" if value is None else f"{100 * value:.0f}%"
        print(f"memdoctor vs best hand config{' (fp32)' if key == 'ratio_fp32' else ''} ({best}): {shown}")
    for key, what in (("memory_error", "verified plan"), ("first_shot_memory_error", "first shot")):
        if result.get(key) is not None:
            print(f"{what}: measured reserved peak {100 * result[key]:+.1f}% against predicted")
    if result.get("first_shot_ratio") is not None:
        print(f"first shot vs verified plan: {100 * result['first_shot_ratio']:.0f}% (target 90%)")


if __name__ == "__main__":
    raise SystemExit(main())
