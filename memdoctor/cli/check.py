"""``memdoctor check``: a CI guard that exits non-zero when a recorded run's peak memory (or step time)
exceeds a limit."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, arg_type, positive_float
from memdoctor.units import parse_size


def configure_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or a report folder")
    p.add_argument(
        "--max-peak", type=arg_type(parse_size), metavar="SIZE", help="the peak memory allowed, e.g. 7.5GiB"
    )
    p.add_argument(
        "--max-step-time-ratio",
        type=arg_type(positive_float),
        metavar="X",
        help="the step time allowed, as a multiple of --baseline's (e.g. 1.1)",
    )
    p.add_argument("--baseline", type=Path, metavar="TRACE", help="the run to compare the step time with")
    p.epilog = (
        f"exit codes: {exitcodes.OK} within the limits; {exitcodes.LIMIT_EXCEEDED} a limit is exceeded "
        f"(one line says by how much); {exitcodes.USAGE_ERROR} usage error; "
        f"{exitcodes.TRACE_ERROR} unreadable trace"
    )


def check_command(ns: argparse.Namespace) -> int:
    from memdoctor.compare import check_run, load_run

    baseline = load_run(ns.baseline) if ns.baseline is not None else None
    verdict = check_run(load_run(ns.trace), ns.max_peak, ns.max_step_time_ratio, baseline)
    for line in verdict.lines:
        print(line)
    return exitcodes.OK if verdict.ok else exitcodes.LIMIT_EXCEEDED


COMMAND = Command(
    "check",
    "exit non-zero when a recorded run's peak memory (or step time) exceeds a limit: a CI guard",
    configure_check,
    check_command,
)
