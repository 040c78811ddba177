"""``memdoctor run``: run a training script to its end with a memdoctor.yaml plan applied, unmodified."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import PROG, Command
from memdoctor.cli.scripts import add_script_arguments, check_target
from memdoctor.cli.terminal import say

_RUN_USAGE = f"{PROG} run --config PATH [options] (SCRIPT | -m MODULE) [--] [SCRIPT ARGS ...]"
_RUN_EPILOG = f"""\
examples:
  {PROG} run --config memdoctor-report/memdoctor.yaml train.py -- --batch-size 32
  {PROG} run --config memdoctor.yaml -m mypackage.train --epochs 3

Runs the script to its end with the plan applied at runtime (the script is not edited); one line per
applied part is printed at the start. A part that cannot be applied stops the run with one line naming
it (exit code {exitcodes.USAGE_ERROR}). Otherwise the exit code is the script's. \
How each part is applied: docs/config.md.
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


def run_command(ns: argparse.Namespace) -> int:
    from memdoctor.config import load_config

    config = load_config(ns.config)
    check_target(ns, "run")
    from memdoctor.launch.run import describe, run_script  # the launch layer; imported late (--help)

    say(describe(config, ns.config))
    return int(run_script(config, None if ns.module else ns.script, ns.module, list(ns.script_args)))


COMMAND = Command(
    "run",
    "run a training script to its end with a memdoctor.yaml plan applied, unmodified",
    configure_run,
    run_command,
    passes_args_through=True,
)
