"""``memdoctor diff``: compare two recorded runs side by side, on the terminal and as HTML with -o."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command
from memdoctor.cli.terminal import print_diff, print_written
from memdoctor.errors import OutputError


def configure_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, metavar="A", help="the first run: a trace.jsonl.gz or a report folder")
    p.add_argument("b", type=Path, metavar="B", help="the second run")
    p.add_argument("-o", "--output", type=Path, metavar="DIR", help="also write DIR/diff.html")
    p.epilog = (
        f"exit codes: {exitcodes.OK} compared; {exitcodes.USAGE_ERROR} usage or output folder error; "
        f"{exitcodes.TRACE_ERROR} unreadable trace"
    )


def diff_command(ns: argparse.Namespace) -> int:
    from memdoctor.compare import diff_runs, load_run
    from memdoctor.outputs import atomic_write
    from memdoctor.report.diff import DIFF_FILENAME, render_diff_html

    data = diff_runs(load_run(ns.a), load_run(ns.b))
    print_diff(data)
    if ns.output is not None:
        target = Path(ns.output) / DIFF_FILENAME
        try:
            Path(ns.output).mkdir(parents=True, exist_ok=True)
            atomic_write(target, render_diff_html(data))
        except OSError as exc:
            raise OutputError(f"{ns.output}: cannot write {DIFF_FILENAME} ({exc.strerror or exc})") from None
        print_written([target])
    return exitcodes.OK


COMMAND = Command(
    "diff",
    "compare two recorded runs side by side (terminal, and HTML with -o)",
    configure_diff,
    diff_command,
)
