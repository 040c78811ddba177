"""``memdoctor report``: re-render report.html and summary.json from a trace file, on any machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, trace_file
from memdoctor.cli.terminal import print_summary, print_written, say
from memdoctor.errors import OutputError
from memdoctor.outputs import report_output_dir


def configure_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="output folder (default: beside the trace, or <trace folder>/rerender-N when a report is "
        "already there)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite report.html and summary.json in the output folder (nothing else is touched)",
    )
    p.add_argument(
        "--salvage",
        action="store_true",
        help="read a trace that was cut short (no end record: a crashed in-process run, a .partial file) "
        "up to its last whole record; the report says it is incomplete",
    )
    p.epilog = (
        f"exit codes: {exitcodes.OK} written; {exitcodes.USAGE_ERROR} usage or output folder error; "
        f"{exitcodes.TRACE_ERROR} unreadable trace"
    )


def report_command(ns: argparse.Namespace) -> int:
    from memdoctor.launch.saving import Saved, failure_line, write_report_files
    from memdoctor.report import build_summary  # the analysis and report layers; imported late
    from memdoctor.trace import load_trace, paused_gc, unfinished_end

    path = trace_file(ns.trace)
    # The collector paused for the whole command, the terminal's summary too: re-enabled, its first
    # pass would walk every object of the loaded trace once more (about a second for 100,000 steps).
    with paused_gc():  # a loaded trace is millions of objects: see paused_gc
        trace = load_trace(path, salvage=ns.salvage)
        if trace.end is None:  # --salvage of a run that never finished: say so in the report
            trace.end = unfinished_end(len(trace.steps))
        out = report_output_dir(path, ns.output, force=ns.force)  # claimed, as a profile claims its own
        try:
            if out.note:
                say(out.note)
            with trace.frozen():  # the summary, the files and the terminal ask the same of all steps
                summary = build_summary(trace)  # once: for the files and for the terminal
                saved = write_report_files(Saved(kept=path), trace, out.path, summary)
        finally:
            out.release()
        if (
            saved.failed
        ):  # one line: what could not be written and why, what was, and that the trace is intact
            steps = sum(1 for s in trace.steps if s.complete)
            raise OutputError(f"{out.path}: {failure_line(saved, steps)}")
        status, message = summary.get("status"), (trace.end or {}).get("message")
        with trace.frozen():
            print_summary(summary, trace, status=status, message=message)
        print_written(list(saved.paths.values()))
        # Freed here, by reference counting, while the collector still sleeps: once it resumes, its first
        # pass would walk every object allocated meanwhile that is still alive (a second or more).
        del trace, summary
    return exitcodes.OK


COMMAND = Command(
    "report", "re-render report.html and summary.json from a trace file", configure_report, report_command
)
