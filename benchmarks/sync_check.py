"""Does memdoctor synchronise the host with the GPU inside its hooks? (issue 3: "no host sync in hooks")

Run on a CUDA machine from the repository root:

    python benchmarks/sync_check.py --out /tmp/sync-check [-- WORKLOAD ARGS]

It runs the story's workload (default: BERT-base bf16, batch 8, sequence 128, 12 steps: the launch-bound
case where a sync costs most) twice under ``torch.cuda.set_sync_debug_mode("warn")`` through
benchmarks/workloads/sync_debug.py: bare, and under ``memdoctor profile`` with every collector. Every
synchronising call is logged with its Python stack; this script sorts them by origin:

* ``script``: no memdoctor frame on the stack (the workload's own ``loss.item()``, the optimizer...);
* ``memdoctor hook``: a memdoctor frame inside a module forward/backward hook or a tensor hook (the
  hot path: must be zero);
* ``memdoctor step boundary``: memdoctor code at an optimizer step or step end (reading the step's
  figures once per step, after its GPU work);
and prints the memdoctor functions involved. OUT/results.json holds the counts and one stack per origin.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

WRAPPER = "benchmarks/workloads/sync_debug.py"
DEFAULT = [
    *("benchmarks/workloads/bert_story.py", "--steps", "12"),
    *("--batch-size", "8", "--seq-len", "128", "--bf16"),
]
HOOKS = {"_fwd_pre", "_fwd_post", "on_backward", "on_grad", "_pack", "_collect_fwd_pre", "_collect_fwd_post"}
HOOKS |= {"on_forward_pre", "on_forward_post", "_root_call"}


# Frames that say nothing about who made the call: the runner at the bottom of every stack, the
# transfers collector's wrappers of Tensor.to/.item/torch.tensor (they pass the caller's own call
# through: the caller above them decides), and the warning machinery at the top.
SKIP = ("memdoctor/launch/", "memdoctor/capture/transfers.py", "/warnings.py", "sync_debug.py")


def origin(stack: list[str]) -> tuple[str, str]:
    """(origin, site) of one logged synchronisation: memdoctor when memdoctor code made the call."""
    frames = [f for f in stack if not any(k in f for k in SKIP)]
    ours = [f.split(f"{os.sep}memdoctor{os.sep}", 1)[1] for f in frames if f"{os.sep}memdoctor{os.sep}" in f]
    if not ours:
        return "script", (frames[-1].rsplit(os.sep, 1)[-1] if frames else "?")
    names = {f.rsplit(":", 1)[1] for f in ours}
    return ("memdoctor hook" if names & HOOKS else "memdoctor step boundary"), ours[-1]


def run(out: Path, name: str, cmd: list[str]) -> list[dict]:
    log = out / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "SYNC_LOG": str(log)}
    with (out / f"{name}.log").open("w") as fh:
        rc = subprocess.call(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    print(f"{name}: exit {rc}", flush=True)
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def summarize(records: list[dict]) -> dict:
    by_origin: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = {}
    for rec in records:
        kind, where = origin(rec["stack"])
        by_origin[kind] += 1
        by_function[f"{kind}: {where}"] += 1
        examples.setdefault(kind, rec["stack"][-8:])
    return {
        "total": len(records),
        "by_origin": dict(by_origin),
        "by_function": dict(by_function),
        "examples": examples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sync-check")
    ap.add_argument("workload", nargs=argparse.REMAINDER, help="after --: the workload and its arguments")
    args = ap.parse_args()
    workload = [a for a in args.workload if a != "--"] or DEFAULT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bare = run(out, "bare", [sys.executable, WRAPPER, *workload])
    prof = [sys.executable, "-m", "memdoctor", "profile", "--steps", "11", "--force"]  # 1 + 11: all 12 steps
    prof += ["-o", str(out / "profiled")]
    profiled = run(out, "profiled", [*prof, WRAPPER, "--", *workload])
    results = {"workload": workload, "bare": summarize(bare), "profiled": summarize(profiled)}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    for name in ("bare", "profiled"):
        r = results[name]
        print(f"{name:9} {r['total']:5} syncs  {r['by_origin']}")
        for fn, n in sorted(r["by_function"].items(), key=lambda kv: -kv[1]):
            print(f"          {n:5}  {fn}")


if __name__ == "__main__":
    main()
