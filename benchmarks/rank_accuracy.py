"""Per-rank prediction accuracy of the planner on the CPU (issue 17, point 6): predicted per-rank peak vs
the per-rank hook ledger, for DDP, FSDP2 and FSDP2 without resharding after forward, on two models.

Run from the repository root (CPU, gloo; about a minute and a half on 2 cores):

    python benchmarks/rank_accuracy.py --out /tmp/rank-accuracy [--models mlp=64,transformer=16]
        [--world 2] [--explain] [--record tests/data]

For each model of ``tests/scripts/rank_models.py`` (a one-process script: a DataLoader, AdamW) at its
global batch (``--models NAME=BATCH``):

1. ``memdoctor profile`` runs it in one process at the global batch;
2. the planner predicts each engine's per-rank peak for ``--world`` ranks from that trace, in this
   process: ``memdoctor.plan.model.predict`` of ``Config(gpus=N, parallel=ENGINE, shard_modules=the
   repeated blocks for FSDP2)``, no other lever;
3. ``memdoctor profile --nproc-per-node N --config`` runs the same script with that engine applied
   (each rank reads 1/N of every batch: the global batch is the script's, as the planner assumes), and
   each rank's measured peak is its hook ledger's (its trace's ``peak_memory_bytes``);
4. it prints predicted vs measured per rank with the error (``--explain``: the predicted parts beside
   the measured categories at the rank's peak), and the same engine planned back from rank 0's trace
   (``memdoctor plan RANK_TRACE --gpus N``: its one-process equivalent); the rows go to
   OUT/results.json.

``--record DIR`` copies the one-process trace and each engine's rank traces with ``ranks.json`` into
DIR: ``cpu-<model>-b<B>.jsonl.gz`` and ``cpu-<model>-b<B>-<engine>-<N>ranks/``, which
``tests/test_rank_accuracy.py`` checks again without starting a process. ``--reuse`` compares what OUT
already holds (after a change to the planner).

Target (issue 17): every rank within 5%. Exit code 1 when a rank is not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "rank_models.py"
ENGINES = ("ddp", "fsdp2", "fsdp2-no-reshard")
MODELS = "mlp=64,transformer=16"  # each model's global batch: a rank computes 1/N of it
BLOCKS = tuple(f"blocks.{i}" for i in range(4))  # rank_models.py's repeated blocks
TARGET = 0.05


@dataclass(frozen=True)
class Run:
    """One model at its global batch over ``world`` ranks."""

    model: str
    batch: int
    world: int = 2

    def name(self, engine: str | None = None) -> str:
        """The recorded trace's name (one process) or rank folder's (an engine), under tests/data."""
        base = f"cpu-{self.model}-b{self.batch}"
        return base if engine is None else f"{base}-{engine}-{self.world}ranks"

    def script_args(self) -> list[str]:
        return ["--model", self.model, "--batch-size", str(self.batch)]


def config_text(engine: str, world: int) -> str:
    """The memdoctor.yaml of one engine on ``world`` ranks, no other lever."""
    text = f"memdoctor_config: 1\ngpus: {world}\nparallel: {engine}\n"
    if engine != "ddp":
        text += f"shard_modules: [{', '.join(BLOCKS)}]\n"
    return text


def memdoctor(args: list[str]) -> None:
    """``python -m memdoctor ARGS`` with this checkout first on the path, one thread a process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"memdoctor {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


# ----------------------------------------------------------------------------------------- compare


def predicted(trace_path: Path, world: int, engines: tuple[str, ...] = ENGINES) -> dict[str, Any]:
    """Each engine's predicted per-rank peak and its parts for ``world`` ranks, from a trace: a
    one-process trace, or a rank's (planned from its one-process equivalent, ``parallel.from_rank``)."""
    from memdoctor.plan.config import Config
    from memdoctor.plan.model import predict, workload
    from memdoctor.report.summary import build_summary
    from memdoctor.trace import load_trace

    trace = load_trace(trace_path)
    w = workload(trace, build_summary(trace))
    if w is None:
        raise SystemExit(f"{trace_path}: the planner found no workload in it")
    out = {}
    for engine in engines:
        blocks = () if engine == "ddp" else tuple(n for n in w.shard_names if n in BLOCKS)
        p = predict(w, Config(gpus=world, parallel=engine, shard_modules=blocks))
        out[engine] = {"peak_bytes": p.peak_bytes, "breakdown": p.breakdown}
    return out


def measured(folder: Path, world: int) -> list[dict[str, Any]]:
    """Each rank's peak from its trace (its summary built again: what a recorded folder holds)."""
    from memdoctor.report.summary import build_summary
    from memdoctor.trace import load_trace

    ranks = []
    for rank in range(world):
        s = build_summary(load_trace(folder / f"rank-{rank}" / "trace.jsonl.gz"))
        cats = {k: v for k, v in (s.get("categories") or {}).items() if v}
        ranks.append({"peak_bytes": s["peak_memory_bytes"], "phase": s.get("peak_phase"), "categories": cats})
    return ranks


def rows(run: Run, trace_path: Path, folders: dict[str, Path]) -> list[dict[str, Any]]:
    """Predicted vs measured, one row per (engine, rank)."""
    pred = predicted(trace_path, run.world)
    out = []
    for engine, folder in folders.items():
        p = pred[engine]
        again = predicted(folder / "rank-0" / "trace.jsonl.gz", run.world, (engine,))[engine]["peak_bytes"]
        for rank, m in enumerate(measured(folder, run.world)):
            out.append(
                {
                    "model": run.model,
                    "batch": run.batch,
                    "world": run.world,
                    "engine": engine,
                    "rank": rank,
                    "predicted_bytes": p["peak_bytes"],
                    "measured_bytes": m["peak_bytes"],
                    "error": (p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"],
                    "from_rank0_bytes": again,
                    "from_rank0_error": (again - m["peak_bytes"]) / m["peak_bytes"],
                    "measured_phase": m["phase"],
                    "measured_categories": m["categories"],
                    "predicted_breakdown": {k: v for k, v in p["breakdown"].items() if v},
                }
            )
    return out


# ----------------------------------------------------------------------------------------- measure


def profile(run: Run, out: Path, steps: int) -> tuple[Path, dict[str, Path]]:
    """The one-process profile and each engine's N-rank profile of ``run`` under ``out``."""
    base = out / f"{run.model}-b{run.batch}"
    one = base / "one"
    memdoctor(
        ["profile", "--steps", str(steps), "-o", str(one), "--force", str(SCRIPT), "--", *run.script_args()]
    )
    folders = {}
    for engine in ENGINES:
        cfg = base / f"{engine}-{run.world}.yaml"
        cfg.write_text(config_text(engine, run.world))
        dest = base / f"{engine}-{run.world}ranks"
        launch = ["--nproc-per-node", str(run.world), "--config", str(cfg), "--steps", str(steps)]
        memdoctor(["profile", *launch, "-o", str(dest), "--force", str(SCRIPT), "--", *run.script_args()])
        folders[engine] = dest
    return one / "trace.jsonl.gz", folders


def reused(run: Run, out: Path) -> tuple[Path, dict[str, Path]]:
    base = out / f"{run.model}-b{run.batch}"
    return base / "one" / "trace.jsonl.gz", {e: base / f"{e}-{run.world}ranks" for e in ENGINES}


def record(run: Run, trace_path: Path, folders: dict[str, Path], data: Path) -> None:
    """Copy what the fast test checks into ``data``: the traces and ranks.json, nothing rendered."""
    shutil.copyfile(trace_path, data / f"{run.name()}.jsonl.gz")
    for engine, folder in folders.items():
        dest = data / run.name(engine)
        if dest.exists():
            shutil.rmtree(dest)
        for rank in range(run.world):
            (dest / f"rank-{rank}").mkdir(parents=True)
            shutil.copyfile(
                folder / f"rank-{rank}" / "trace.jsonl.gz", dest / f"rank-{rank}" / "trace.jsonl.gz"
            )
        shutil.copyfile(folder / "ranks.json", dest / "ranks.json")
        print(f"Wrote {dest}")


# ----------------------------------------------------------------------------------------- print


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model (global batch) | engine | ranks | rank | predicted MiB | measured MiB | error "
        "| measured peak in | from rank 0's trace MiB | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} (B={r['batch']}) | {r['engine']} | {r['world']} | {r['rank']} "
            f"| {mib(r['predicted_bytes'])} | {mib(r['measured_bytes'])} | {r['error']:+.1%} "
            f"| {r['measured_phase']} | {mib(r['from_rank0_bytes'])} | {r['from_rank0_error']:+.1%} |"
        )
    return "\n".join(lines)


def explain(results: list[dict[str, Any]]) -> str:
    """Each row's predicted parts beside the measured categories at the rank's peak (MiB)."""
    out = []
    for r in results:
        pred = ", ".join(f"{k} {mib(v)}" for k, v in r["predicted_breakdown"].items())
        meas = ", ".join(f"{k} {mib(v)}" for k, v in r["measured_categories"].items())
        out.append(
            f"{r['model']} B={r['batch']} {r['engine']} rank {r['rank']}/{r['world']}:\n"
            f"  predicted: {pred}\n  measured:  {meas}"
        )
    return "\n".join(out)


def parse_models(text: str, world: int) -> list[Run]:
    runs = []
    for item in text.split(","):
        name, _, batch = item.partition("=")
        runs.append(Run(name, int(batch), world))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/memdoctor-rank-accuracy"))
    p.add_argument("--models", default=MODELS, help=f"NAME=GLOBAL_BATCH,... (default {MODELS})")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--record", type=Path, metavar="DIR", help="copy the traces into DIR (tests/data)")
    p.add_argument("--reuse", action="store_true", help="compare what OUT already holds, profile nothing")
    p.add_argument("--explain", action="store_true", help="print the predicted parts and measured categories")
    args = p.parse_args(argv)
    results = []
    for run in parse_models(args.models, args.world):
        trace_path, folders = reused(run, args.out) if args.reuse else profile(run, args.out, args.steps)
        if args.record:
            record(run, trace_path, folders, args.record)
        results += rows(run, trace_path, folders)
    print(table(results))
    if args.explain:
        print(explain(results))
    worst = max(max(abs(r["error"]), abs(r["from_rank0_error"])) for r in results)
    print(f"worst |error| {worst:.1%} (target {TARGET:.0%})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
