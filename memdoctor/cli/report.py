"""``memdoctor report``: re-render report.html and summary.json from a trace file, on any machine; on a
multi-rank profile's folder (``rank-K/`` folders, ``ranks.json``), the merged report across its ranks."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.cli.arguments import Command, trace_file
from memdoctor.cli.terminal import one_line, print_summary, print_written, say
from memdoctor.errors import MemdoctorError, OutputError, UsageError
from memdoctor.outputs import REPORT_FILES, ensure_writable, report_output_dir
from memdoctor.trace import TRACE_FILENAME
from memdoctor.units import format_bytes


def configure_report(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        type=Path,
        metavar="TRACE",
        help="a trace.jsonl.gz, the folder holding one, or a multi-rank profile's folder (its rank-K/ "
        "folders are merged into one report)",
    )
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
    p.add_argument(
        "--each-rank",
        action="store_true",
        help="on a multi-rank folder, also re-render each rank's report.html and summary.json from its "
        "trace (into rank-K/ of the output folder) before merging them",
    )
    p.epilog = (
        f"exit codes: {exitcodes.OK} written; {exitcodes.USAGE_ERROR} usage or output folder error; "
        f"{exitcodes.TRACE_ERROR} unreadable trace"
    )


def report_command(ns: argparse.Namespace) -> int:
    from memdoctor.launch.saving import Saved, failure_line, write_report_files
    from memdoctor.report import build_summary  # the analysis and report layers; imported late
    from memdoctor.report.ranks import is_multi_rank
    from memdoctor.trace import load_trace, paused_gc, unfinished_end

    if ns.trace.is_dir() and not (ns.trace / TRACE_FILENAME).is_file() and is_multi_rank(ns.trace):
        return report_ranks(ns)
    if ns.each_rank:
        raise UsageError(f"{ns.trace}: --each-rank is for a multi-rank profile's folder (rank-K/ folders)")
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


def report_ranks(ns: argparse.Namespace) -> int:
    """The merged report of a multi-rank folder, into the folder itself unless it has a report already
    (then ``rerender-N`` inside it, as for a trace; ``-o`` and ``--force`` as for a trace). With
    ``--each-rank`` each rank's report and summary are re-rendered first, into ``rank-K/`` there."""
    from memdoctor.report.ranks import RANKS_FILENAME, rank_folders, write_merged

    folder: Path = ns.trace
    out = report_output_dir(folder / RANKS_FILENAME, ns.output, force=ns.force)
    try:
        if out.note:
            say(out.note)
        if ns.each_rank:
            rerender_ranks(folder, rank_folders(folder), out.path, force=ns.force)
        paths = write_merged(folder, out.path)
    finally:
        out.release()
    print_ranks(json.loads(paths["summary"].read_text(encoding="utf-8")))
    print_written(list(paths.values()))
    return exitcodes.OK


def rerender_ranks(source: Path, folders: dict[int, Path], dest: Path, *, force: bool) -> None:
    """Each rank's report.html and summary.json from its trace, into its folder's place under ``dest``
    (``dest/rank-K``, where the merged report looks for it first); a rank whose trace cannot be read is
    said and skipped (the merged report names it too). A folder that has a report already is
    overwritten only with ``--force``: checked for every rank before any is written."""
    from memdoctor.report import write_report
    from memdoctor.trace import load_trace, paused_gc

    targets = {rank: dest / os.path.relpath(f, source) for rank, f in folders.items()}
    held = [t for t in targets.values() if not force and any((t / n).exists() for n in REPORT_FILES)]
    if held:
        raise UsageError(
            f"{held[0]}: already has a report; pass --force to overwrite it, or -o DIR to write elsewhere"
        )
    for rank, path in sorted(folders.items()):
        try:
            with paused_gc():
                trace = load_trace(path / TRACE_FILENAME)
                write_report(trace, ensure_writable(targets[rank]))
        except MemdoctorError as exc:
            say(f"rank {rank}: not re-rendered: {one_line(exc)}")


def print_ranks(summary: dict[str, Any]) -> None:
    """The merged summary in a few lines: the headline, then a line per rank."""
    print(summary["headline"])
    for row in summary["ranks"]:
        peak = (
            format_bytes(row["peak_memory_bytes"]) if row["peak_memory_bytes"] is not None else "not measured"
        )
        step = f"{row['step_time_ms']:.1f} ms" if row["step_time_ms"] is not None else "not measured"
        print(f"  rank {row['rank']}: {row['status']}, peak {peak}, step {step} (measured)")
    for problem in summary["problems"]:
        say(problem)


COMMAND = Command(
    "report", "re-render report.html and summary.json from a trace file", configure_report, report_command
)
