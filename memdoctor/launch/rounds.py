"""The rounds ``memdoctor profile`` runs after the first profile: re-profile (``--reprofile``, when the
run died before its forward finished) and verify (``--verify``).

Both loops (``launch/reprofile.py``, ``launch/verify.py``) return one run-wide record; here it is written
into the FIRST trace and that run's report, ``summary.json`` and memdoctor.yaml are re-rendered from
it, so that ``memdoctor report`` re-renders the same pages from the trace alone. The exit code stays
the first run's: it says how the profiled script ended.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memdoctor.analysis.verified import what_to_try
from memdoctor.config import CONFIG_FILENAME
from memdoctor.launch import reprofile, verify
from memdoctor.launch.supervisor import ProfileRequest, ProfileResult, Runner, Say
from memdoctor.trace import Trace, read_trace, save_trace

REPROFILE_FILES = ("trace.jsonl.gz", "summary.json", "report.html")
VERIFY_FILES = ("trace.jsonl.gz", "summary.json", "report.html", "memdoctor.yaml")


def reprofile_profile(
    request: ProfileRequest,
    result: ProfileResult,
    rounds: int,
    run: Runner,
    say: Say,
) -> tuple[ProfileResult, list[Path]]:
    """When the run died of OOM before its forward finished: re-profile at smaller micro-batches,
    record the result in the first trace and re-render its report, summary and memdoctor.yaml, which
    now plan from the re-profile. (the result with the new summary, the files the re-profiles wrote)."""
    trace = read_trace(result.trace_path)
    if trace is None or result.summary is None or not reprofile.needed(trace, result):
        return result, []
    record = reprofile.reprofile(trace, result.summary, request, run, say, max_rounds=rounds)
    assert result.trace_path is not None  # read_trace found a trace there
    paths = record_and_render(trace, result.trace_path, reprofile.RECORD_NAME, record, request.out_dir)
    summary = json.loads(paths["summary"].read_text(encoding="utf-8"))
    files = round_files(request.out_dir, record, REPROFILE_FILES)
    return dataclasses.replace(result, summary=summary), files


def verify_profile(
    request: ProfileRequest,
    result: ProfileResult,
    rounds: int,
    run: Runner,
    say: Say,
) -> list[Path]:
    """``profile --verify``: verify the first run's plan, record the result in the first trace and
    re-render its report; the files the rounds wrote. When no round fitted, says so, with what
    memdoctor.yaml now holds and what to try (the note its header carries)."""
    trace = read_trace(result.trace_path)
    if trace is None or result.summary is None or result.exit_code not in verify.VERIFIABLE_EXIT_CODES:
        say(f"verify: not verified: the profiled run ended with {result.status}; fix that first")
        return []
    record = verify.verify(trace, result.summary, request, run, say, max_rounds=rounds)
    assert result.trace_path is not None  # read_trace found a trace there
    paths = record_and_render(trace, result.trace_path, verify.RECORD_NAME, record, request.out_dir)
    plan = json.loads(paths["summary"].read_text(encoding="utf-8")).get("plan") or {}
    if plan.get("verified_fits") is False:  # each round's line said why it failed
        where = paths.get("config", CONFIG_FILENAME)
        say(f"verify: no round fits the budget: {where} is NOT planned to fit. {what_to_try(trace, plan)}")
    return round_files(request.out_dir, record, VERIFY_FILES)


def record_and_render(
    trace: Trace, path: Path, name: str, record: dict[str, Any], out_dir: Path
) -> dict[str, Path]:
    """Write the run-wide ``record`` into the first run's trace (atomically) and re-render its report,
    ``summary.json`` and memdoctor.yaml from it; their paths."""
    from memdoctor.report import write_report  # the report layer; imported late (matplotlib)

    trace.collected[name] = record
    save_trace(trace, path)
    return write_report(trace, out_dir)


def round_files(out_dir: Path, record: dict[str, Any], names: Sequence[str]) -> list[Path]:
    """The files ``names`` in the folder of each round of ``record`` (its ``trace`` is relative)."""
    return [(out_dir / r["trace"]).parent / name for r in record["rounds"] for name in names]
