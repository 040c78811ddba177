"""``memdoctor run``: run a training script to its end with a memdoctor.yaml plan applied, unmodified."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import PROG, Command, add_launch_options, rank_job
from memdoctor.cli.scripts import add_script_arguments, check_target
from memdoctor.cli.terminal import say

_RUN_USAGE = f"{PROG} run --config PATH [options] (SCRIPT | -m MODULE) [--] [SCRIPT ARGS ...]"
_RUN_EPILOG = f"""\
examples:
  {PROG} run --config memdoctor-report/memdoctor.yaml train.py -- --batch-size 32
  {PROG} run --config memdoctor.yaml -m mypackage.train --epochs 3
  {PROG} run --config memdoctor.yaml --nproc-per-node 2 train.py -- --epochs 3

Runs the script to its end with the plan applied at runtime (the script is not edited); one line per
applied part is printed at the start. A part that cannot be applied stops the run with one line naming
it (exit code {exitcodes.USAGE_ERROR}). Otherwise the exit code is the script's; \
with --nproc-per-node, the first rank to fail's. How each part is applied: docs/config.md.
"""


def configure_run(p: argparse.ArgumentParser) -> None:
    add_script_arguments(p, _RUN_USAGE, _RUN_EPILOG)
    p.add_argument(
        "--config",
        type=Path,
        required=True,
        metavar="PATH",
        help="the plan: a memdoctor.yaml (docs/config.md)",
    )
    add_launch_options(p)


def run_command(ns: argparse.Namespace) -> int:
    from memdoctor.config import load_config

    config = load_config(ns.config)
    check_target(ns, "run")
    job = rank_job(ns)  # --nproc-per-node: a torch.distributed.run job; None for one process
    from memdoctor.launch.run import describe, run_script  # the launch layer; imported late (--help)

    say(describe(config, ns.config))
    processes = 1 if job is None else job.world_size
    if config.gpus > 1 and processes != config.gpus:
        started = f"{processes} process" + ("" if processes == 1 else "es")
        say(f"note: the plan is for gpus: {config.gpus}; this run starts {started} (see --nproc-per-node)")
    script = None if ns.module else ns.script
    if job is None:
        return int(run_script(config, script, ns.module, list(ns.script_args)))
    from memdoctor.launch.rank_outcome import outcome_lines, run_ranks

    say(f"running on {job.nproc_per_node} processes per node (torch.distributed.run), the plan on each rank")
    result = run_ranks(ns.config, script, ns.module, list(ns.script_args), job)
    for line in [*outcome_lines(result), *result.notes]:
        say(line)
    return int(result.exit_code)


COMMAND = Command(
    "run",
    "run a training script to its end with a memdoctor.yaml plan applied, unmodified",
    configure_run,
    run_command,
    passes_args_through=True,
)
