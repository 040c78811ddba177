"""``memdoctor timeline``: write a trace's memory timeline for another viewer: a Chrome/Perfetto trace
(ui.perfetto.dev, chrome://tracing) or a PyTorch memory snapshot (pytorch.org/memory_viz)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, trace_file
from memdoctor.cli.terminal import print_written, say
from memdoctor.errors import OutputError, UsageError

FORMAT_NAMES = ("perfetto", "memory-viz")  # memdoctor.viewers.FORMATS, named here for --help without imports
VIEW_HINT = {
    "perfetto": "open it in https://ui.perfetto.dev (or chrome://tracing)",
    "memory-viz": "drop it on https://pytorch.org/memory_viz (synthetic blocks: one per change of a "
    "category's total, not one per tensor)",
}


def configure_timeline(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    p.add_argument(
        "--format",
        choices=FORMAT_NAMES,
        default="perfetto",
        help="perfetto: Chrome trace-event JSON, memory as counters and steps, phases and module calls as "
        "slices (default); memory-viz: a torch.cuda.memory._snapshot() pickle",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="the file to write (default: memory-timeline.json or memory-timeline.pickle beside the trace)",
    )
    p.add_argument("--force", action="store_true", help="overwrite FILE when it exists")
    p.add_argument(
        "--salvage", action="store_true", help="read a trace that was cut short up to its last whole record"
    )
    p.epilog = (
        f"exit codes: {exitcodes.OK} written; {exitcodes.USAGE_ERROR} usage or output error; "
        f"{exitcodes.TRACE_ERROR} unreadable trace"
    )


def timeline_command(ns: argparse.Namespace) -> int:
    from memdoctor.outputs import atomic_write
    from memdoctor.trace import load_trace
    from memdoctor.viewers import FORMATS

    path = trace_file(ns.trace)
    write, suffix = FORMATS[ns.format]
    target = ns.output if ns.output is not None else path.resolve().parent / f"memory-timeline{suffix}"
    _check_target(target, ns.force)
    trace = load_trace(path, salvage=ns.salvage)
    atomic_write(target, write(trace))
    print_written([target])
    say(VIEW_HINT[ns.format])
    return exitcodes.OK


def _check_target(target: Path, force: bool) -> None:
    """Refuse, in one line and before reading the trace, a FILE that cannot be (or may not be) written."""
    if target.is_dir():
        raise UsageError(f"{target}: is a folder; give a file name with -o")
    if target.exists() and not force:
        raise UsageError(f"{target}: exists; give --force to overwrite it, or another -o FILE")
    if not target.parent.is_dir():
        raise OutputError(f"{target.parent}: no such folder; create it first, or choose another -o FILE")


COMMAND = Command(
    "timeline",
    "write a trace's memory timeline for Perfetto (Chrome trace JSON) or PyTorch's memory_viz",
    configure_timeline,
    timeline_command,
)
