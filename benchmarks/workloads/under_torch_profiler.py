"""Run a training script, unmodified, under ``torch.profiler`` on chosen optimizer steps: the yardstick
that memdoctor's overhead is compared with (issue 3, point 9).

    python benchmarks/workloads/under_torch_profiler.py [--warmup W] [--steps S] SCRIPT [ARGS ...]

The script runs as ``python SCRIPT ARGS`` would (``runpy``, as ``__main__``, with its own ``sys.argv``
and ``sys.path[0]``) inside ``torch.profiler.profile(profile_memory=True, record_shapes=True,
with_stack=True)``. PyTorch's global optimizer step post hook calls ``prof.step()`` after every
optimizer step, so the schedule counts the script's own training steps: steps ``0 .. W-1`` run without
the profiler (step ``W-1`` is the profiler's own warm-up, as ``torch.profiler.schedule`` wants), steps
``W .. W+S`` are recorded. One step more than S is recorded so that the profiler's teardown (it stops
tracing and collects the events inside the ``prof.step()`` that ends the window) lands after step
``W+S-1``: the steps ``W .. W+S-1`` that the benchmark times, the same steps memdoctor profiles with
``--warmup W --steps S``, carry the tracing cost but not the teardown. The trace is exported only with
``--trace-out`` and only after the script has ended, so the export is not timed either.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=2, help="steps before the recorded ones (>= 1)")
    p.add_argument("--steps", type=int, default=8, help="recorded (timed) steps")
    p.add_argument("--trace-out", default=None, metavar="PATH", help="export a Chrome trace after the run")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if ns.warmup < 1:
        p.error("--warmup must be at least 1: the profiler warms up on the step before the recorded ones")
    return ns


def activities() -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


def run_script(script: str, args: list[str]) -> None:
    """``python SCRIPT ARGS``: as __main__, with the script's argv and its folder first on sys.path."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script's own sys.exit(0) is a normal end
        if exc.code not in (None, 0):
            raise


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    ready: list[Any] = []
    prof = profile(
        activities=activities(),
        schedule=schedule(skip_first=ns.warmup - 1, wait=0, warmup=1, active=ns.steps + 1, repeat=1),
        on_trace_ready=ready.append,  # keep it; exporting here would be timed as part of a step
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: prof.step())
    try:
        with prof:
            run_script(ns.script, ns.args)
    finally:
        handle.remove()
    window = f"steps {ns.warmup}..{ns.warmup + ns.steps}"
    # (not prof.events(): building every FunctionEvent of a BERT-base window takes long, for nothing)
    print(f"torch.profiler {'recorded' if ready else 'did NOT complete its window over'} {window}")
    if ns.trace_out and ready:
        prof.export_chrome_trace(ns.trace_out)
        print(f"Wrote {ns.trace_out}")


if __name__ == "__main__":
    main()
