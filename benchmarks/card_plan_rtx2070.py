"""A plan for the card, measured (issue 16, point 2): ``profile --gpu rtx2070`` of the story, then ``run``.

The story's workload (``benchmarks/workloads/bert_story.py``: BERT-base, batch 32, every sequence padded
to 512, fp32, AdamW, a plain loop) is profiled on the larger GPU with ``memdoctor profile --gpu CARD``
(default ``rtx2070``): the process is capped to the card's usable memory (its 8 GiB less memdoctor's
512 MiB context reserve, as ``--budget`` caps: ``torch.cuda.set_per_process_memory_fraction``), and the
plan is made for the card's features (the RTX 2070, Turing: no bf16, fp16 tensor cores, PCIe Gen3, its
datasheet FLOP rates). Then ``memdoctor run --config OUT/profile/memdoctor.yaml`` trains the unmodified
script with that plan under the same cap (the workload's own ``--memory-cap-gib``), and this prints:

- the plan's precision and levers, and its GradScaler settings;
- whether the run's GradScaler was active: ``memdoctor run``'s end-of-run line "fp16 loss scaling: N
  optimizer step(s) through torch.amp.GradScaler, scale A at the start, B at the end";
- the run's measured peak (``torch.cuda.max_memory_reserved`` / ``max_memory_allocated`` from the
  workload's ``--peak-file``) against the cap, and its samples/s (median of the last step times);

and, last, one JSON line for BENCHMARKS.md (also written to OUT/result.json). On the H200 (the lead
runs it there; a few minutes):

    python benchmarks/card_plan_rtx2070.py --out /tmp/card-plan

``--tiny`` is a CPU smoke run of the same steps: a 2-layer BERT, a budget of 4 MiB beside the card
(``--gpu`` with ``--budget`` plans for the smaller memory with the card's features), no cap (a CPU run
has none); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "benchmarks" / "workloads" / "bert_story.py"
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GiB = 1024**3
LAST_STEPS = 8  # samples/s from the median of the last LAST_STEPS step times
TINY_BUDGET = "4MiB"  # the tiny story peaks at ~4.9 MB (CPU accounting): a plan is needed
SCALER_LINE = re.compile(
    r"fp16 loss scaling: (\d+) optimizer step\(s\) through torch\.amp\.GradScaler, scale (\S+) at the "
    r"start, (\S+) at the end"
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cap = card_cap(args.gpu)
    profile = run_profile(args)
    config = args.out / "profile" / "memdoctor.yaml"
    result: dict[str, Any] = {
        "benchmark": "card_plan",
        "card": args.gpu,
        "workload": "bert_story b32 s512 fp32" if not args.tiny else "bert_story --tiny (CPU smoke)",
        "cap_bytes": None if args.tiny else cap,
        "profile": profile,
        "plan": read_plan(args.out / "profile" / "summary.json"),
        "run": None,
    }
    if config.exists():
        result["run"] = run_plan(args, config, cap)
    else:
        result["note"] = "no memdoctor.yaml: the profile made no plan (see its report)"
    print_result(result)
    (args.out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, sort_keys=True, separators=(",", ":")))
    return 0 if result["run"] and result["run"]["status"] == "ok" else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("card-plan"), help="default ./card-plan")
    p.add_argument("--gpu", default="rtx2070", help="the card to plan for (default rtx2070)")
    p.add_argument(
        "--steps", type=int, default=None, help="memdoctor run's steps (default 20; 4 with --tiny)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process (default 300)")
    p.add_argument("--verify", action="store_true", help="profile with --verify as well")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: a 2-layer BERT, a 4 MiB budget")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.tiny else 20
    return args


def card_cap(gpu: str) -> int:
    """The card's usable memory: what ``profile --gpu`` caps to, and the run's cap."""
    sys.path.insert(0, str(REPO))
    from memdoctor.cards import find_card

    return find_card(gpu).usable_bytes


def workload_args(args: argparse.Namespace, d: Path, steps: int, cap: int | None) -> list[str]:
    out = [
        "--steps",
        str(steps),
        "--timing-file",
        str(d / "steps.jsonl"),
        "--peak-file",
        str(d / "peak.json"),
    ]
    if args.tiny:
        out += ["--tiny", "--device", "cpu"]
    if cap is not None and not args.tiny:
        out += ["--memory-cap-gib", f"{cap / GiB:.6f}"]
    return out


def run_profile(args: argparse.Namespace) -> dict[str, Any]:
    """``memdoctor profile --gpu CARD`` (memdoctor caps the process itself) into OUT/profile."""
    d = args.out / "profile"
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--gpu", args.gpu, "-o", str(d), "--force"]
    cmd += ["--warmup", "1", "--steps", "3", *(["--budget", TINY_BUDGET] if args.tiny else [])]
    cmd += ["--verify"] if args.verify else []
    cmd += [str(WORKLOAD), "--", *workload_args(args, args.out / "profile-files", 6, None)]
    (args.out / "profile-files").mkdir(parents=True, exist_ok=True)
    proc, wall = execute(cmd, args, args.out / "profile-output.txt")
    summary = _json(d / "summary.json") or {}
    device = summary.get("device") or {}
    return {
        "exit_code": proc.returncode if proc else None,
        "status": summary.get("status"),
        "device": device.get("name"),
        "memory_cap_bytes": device.get("memory_cap_bytes"),
        "reprofiled": bool((summary.get("reprofile") or {}).get("planned_from_reprofile")),
        "wall_s": wall,
    }


def read_plan(path: Path) -> dict[str, Any] | None:
    plan = (_json(path) or {}).get("plan")
    if not plan:
        return None
    return {
        "card": plan.get("card"),
        "budget_bytes": plan.get("budget_bytes"),
        "fits": plan.get("fits"),
        "precision": (plan.get("config") or {}).get("precision"),
        "levers": plan.get("levers"),
        "grad_scaler": plan.get("grad_scaler"),
        "predicted_reserved_bytes": plan.get("predicted_reserved_bytes"),
        "predicted_step_time_ratio": plan.get("predicted_step_time_ratio"),
    }


def run_plan(args: argparse.Namespace, config: Path, cap: int) -> dict[str, Any]:
    """``memdoctor run --config`` on the unmodified workload, capped as the card; what it measured."""
    d = args.out / "run"
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.jsonl", "peak.json"):
        (d / stale).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "memdoctor", "run", "--config", str(config), str(WORKLOAD), "--"]
    proc, wall = execute([*cmd, *workload_args(args, d, args.steps, cap)], args, d / "output.txt")
    text = (d / "output.txt").read_text() if (d / "output.txt").exists() else ""
    return run_measurements(text, proc.returncode if proc else None, d, cap, args.tiny, wall)


def run_measurements(
    text: str, code: int | None, d: Path, cap: int, tiny: bool, wall: float, batch: int = 32
) -> dict[str, Any]:
    """What one ``memdoctor run`` measured, from its output and the workload's files."""
    peak = _json(d / "peak.json") or {}
    steps = [json.loads(line)["step_ms"] for line in _lines(d / "steps.jsonl")]
    oom = bool(peak.get("oom")) or "out of memory" in text or "OutOfMemoryError" in text
    scaler = SCALER_LINE.search(text)
    reserved = peak.get("max_reserved_bytes")
    last = steps[1:][-LAST_STEPS:]  # step 1 includes start-up
    status = "ok" if code == 0 and not oom else "oom" if oom else "failed"
    return {
        "status": status,
        "exit_code": code,
        "grad_scaler_active": scaler is not None and int(scaler.group(1)) > 0,
        "grad_scaler_steps": int(scaler.group(1)) if scaler else 0,
        "grad_scaler_scale": [float(scaler.group(2)), float(scaler.group(3))] if scaler else None,
        "applied": [
            line.removeprefix("memdoctor: ") for line in text.splitlines() if line.startswith("memdoctor:")
        ],
        "max_reserved_bytes": reserved,
        "max_allocated_bytes": peak.get("max_allocated_bytes"),
        "within_cap": None if tiny or reserved is None else reserved <= cap,
        "steps": len(steps),
        "samples_per_s": round((4 if tiny else batch) * 1000.0 / statistics.median(last), 2)
        if last
        else None,
        "wall_s": wall,
    }


def execute(cmd: list[str], args: argparse.Namespace, log: Path) -> tuple[Any, float]:
    print(f"[card-plan] {' '.join(cmd[2:5])} ...", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO, env=OFFLINE
        )
        log.write_text(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"timed out after {args.timeout} s\n{exc.stdout or ''}{exc.stderr or ''}")
        proc = None
    return proc, round(time.monotonic() - start, 1)


def print_result(result: dict[str, Any]) -> None:
    plan, run = result["plan"] or {}, result["run"] or {}
    print(f"card {result['card']}: profiled on {result['profile']['device']}, cap {result['cap_bytes']}")
    print(f"plan: {plan.get('precision')}; {'; '.join(plan.get('levers') or []) or 'as is'}")
    print(f"run: {run.get('status')}; GradScaler active: {run.get('grad_scaler_active')}", end="")
    print(f" ({run.get('grad_scaler_steps')} steps); peak reserved {run.get('max_reserved_bytes')}")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
