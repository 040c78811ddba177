"""``memdoctor plan``: plan for a memory budget or a GPU from a recorded trace, as tables or JSON, and
write it as memdoctor.yaml with ``-o DIR`` (or ``-o FILE.yaml``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, add_gpus, arg_type, trace_file
from memdoctor.cli.terminal import print_plan, print_written, say
from memdoctor.errors import UsageError
from memdoctor.units import parse_size

if TYPE_CHECKING:
    from memdoctor.plan.target import Target


def configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    p.add_argument(
        "--budget", type=arg_type(parse_size), metavar="SIZE", help="memory the plan must fit, e.g. 8GiB"
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="plan for a listed card (rtx2070, t4, a100-80gb, ...; see docs/planner.md): its memory and "
        "its features (bf16 or not, fp16 tensor cores, PCIe rate, FLOP rate); with --budget, the smaller "
        "of the two memories",
    )
    add_gpus(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR|FILE.yaml",
        help="also write the plan as DIR/memdoctor.yaml, or as FILE.yaml when the path ends in .yaml or "
        ".yml (see docs/config.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing memdoctor.yaml")
    p.epilog = (
        "without --budget or --gpu: the profiled run's budget and the card it was profiled for "
        "(profile --gpu), else its GPU; --budget and --gpu are per card with --gpus. "
        f"exit codes: {exitcodes.OK} planned (also when nothing fits: the output says so); "
        f"{exitcodes.USAGE_ERROR} usage error; {exitcodes.TRACE_ERROR} unreadable trace"
    )


def plan_command(ns: argparse.Namespace) -> int:
    from memdoctor.plan.planner import card_table
    from memdoctor.plan.summarize import doctor, ranks_target
    from memdoctor.report import build_summary  # the analysis, plan and report layers; imported late
    from memdoctor.trace import load_trace

    path = trace_file(ns.trace)
    trace = load_trace(path)
    summary = build_summary(trace)
    target = _target(ns, summary, path)
    target = dataclasses.replace(target, gpus=ns.gpus) if ns.gpus else ranks_target(trace, target) or target
    out = doctor(trace, summary, target)
    if out["plan"] is None or out["plan"]["reason"]:
        raise UsageError(f"{path}: cannot plan: {(out['plan'] or out)['reason']}")
    written = write_plan_config(ns.output, trace, {**summary, "plan": out["plan"]}, force=ns.force)
    cards = card_table(out["workload"], target.margin, out["lever_priority"]["order"], target.gpus)
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
        return Target(min(card.usable_bytes, ns.budget or card.usable_bytes), card)
    if ns.budget:
        return Target(ns.budget)
    target = summary_target(summary)
    if target is None:
        raise UsageError(f"{path}: the run had no budget and no GPU: give --budget SIZE or --gpu NAME")
    return target


def write_plan_config(
    out_dir: Path | None, trace: Any, summary: dict[str, Any], *, force: bool
) -> Path | None:
    """``DIR/memdoctor.yaml`` for ``memdoctor plan -o DIR`` (or ``FILE.yaml`` for ``-o FILE.yaml``: one
    file per card beside the trace, as the report's card table writes them): atomic, never over an
    existing file without --force (the same policy as the report's files)."""
    if out_dir is None:
        return None
    from memdoctor.config import CONFIG_FILENAME, config_for_summary, dump_config
    from memdoctor.outputs import atomic_write, ensure_writable

    named = out_dir.suffix.lower() in (".yaml", ".yml") and not out_dir.is_dir()
    target = out_dir if named else out_dir / CONFIG_FILENAME
    if target.exists() and not force:
        raise UsageError(f"{target} exists: give --force to overwrite it, or another -o path")
    config = config_for_summary(trace, summary)
    if config is None:
        return None
    ensure_writable(target.parent)
    atomic_write(target, dump_config(config))
    return target


COMMAND = Command(
    "plan", "plan for a memory budget or a GPU from a recorded trace", configure_plan, plan_command
)
