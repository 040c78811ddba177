"""``memdoctor plan``: plan for a memory budget or a GPU from a recorded trace, as tables or JSON, and
write it as memdoctor.yaml with ``-o DIR``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, arg_type, trace_file
from memdoctor.cli.terminal import print_plan, print_written, say
from memdoctor.errors import UsageError
from memdoctor.units import parse_size

if TYPE_CHECKING:
    from memdoctor.plan.target import Target


def configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--budget", type=arg_type(parse_size), metavar="SIZE", help="memory the plan must fit, e.g. 8GiB"
    )
    target.add_argument(
        "--gpu",
        metavar="NAME",
        help="plan for a listed card (rtx2070, t4, a100-80gb, ...; see docs/planner.md)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="also write the plan as DIR/memdoctor.yaml (see docs/config.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing DIR/memdoctor.yaml")
    p.epilog = (
        "without --budget or --gpu: the profiled run's budget, else its GPU. "
        f"exit codes: {exitcodes.OK} planned (also when nothing fits: the output says so); "
        f"{exitcodes.USAGE_ERROR} usage error; {exitcodes.TRACE_ERROR} unreadable trace"
    )


def plan_command(ns: argparse.Namespace) -> int:
    from memdoctor.plan.planner import card_table
    from memdoctor.plan.summarize import doctor
    from memdoctor.report import build_summary  # the analysis, plan and report layers; imported late
    from memdoctor.trace import load_trace

    path = trace_file(ns.trace)
    trace = load_trace(path)
    summary = build_summary(trace)
    target = _target(ns, summary, path)
    out = doctor(trace, summary, target)
    if out["plan"] is None:
        raise UsageError(f"{path}: cannot plan: {out['reason']}")
    written = write_plan_config(ns.output, trace, {**summary, "plan": out["plan"]}, force=ns.force)
    cards = card_table(out["workload"], target.margin, out["lever_priority"]["order"])
    if ns.json:
        doc = {
            "plan": out["plan"],
            "findings": out["findings"],
            "ninegrid": out["ninegrid"],
            "lever_priority": out["lever_priority"],
            "cards": cards,
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
        if written is not None:
            say(f"Wrote {written}")  # stderr: stdout stays one JSON document
        return exitcodes.OK
    print_plan(out, cards)
    print_written([written])
    return exitcodes.OK


def _target(ns: argparse.Namespace, summary: dict[str, Any], path: Path) -> Target:
    """What to plan for: --gpu's card, --budget, else the profiled run's budget or GPU."""
    from memdoctor.cards import find_card
    from memdoctor.plan.summarize import summary_target
    from memdoctor.plan.target import Target

    if ns.gpu:
        card = find_card(ns.gpu)
        return Target(card.usable_bytes, card)
    if ns.budget:
        return Target(ns.budget)
    target = summary_target(summary)
    if target is None:
        raise UsageError(f"{path}: the run had no budget and no GPU: give --budget SIZE or --gpu NAME")
    return target


def write_plan_config(
    out_dir: Path | None, trace: Any, summary: dict[str, Any], *, force: bool
) -> Path | None:
    """``DIR/memdoctor.yaml`` for ``memdoctor plan -o DIR``: atomic, never over an existing file without
    --force (the same policy as the report's files)."""
    if out_dir is None:
        return None
    from memdoctor.config import CONFIG_FILENAME, config_for_summary, dump_config
    from memdoctor.outputs import atomic_write, ensure_writable

    target = out_dir / CONFIG_FILENAME
    if target.exists() and not force:
        raise UsageError(f"{target} exists: give --force to overwrite it, or another -o DIR")
    config = config_for_summary(trace, summary)
    if config is None:
        return None
    ensure_writable(out_dir)
    atomic_write(target, dump_config(config))
    return target


COMMAND = Command(
    "plan", "plan for a memory budget or a GPU from a recorded trace", configure_plan, plan_command
)
