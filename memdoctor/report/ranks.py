"""The merged report of a multi-rank run: ``OUT/summary.json`` and ``OUT/report.html`` over ``OUT/rank-K/``.

A multi-rank profile folder holds one complete one-process output per rank (``rank-K/trace.jsonl.gz``,
``summary.json``, ``report.html``) and the launcher's ``ranks.json`` (how each rank ended, which failed
first). This module reads them, hands what it read to ``memdoctor.analysis.ranks`` for the figures, and
renders the result; a rank whose files cannot be read is named with the reason, and the others are
still merged. Without ``ranks.json`` (a launcher that died, a folder put together by hand) the ranks
are found from their ``rank-K`` folders and their traces' ``distributed`` header.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from memdoctor.analysis import ranks as merged
from memdoctor.analysis.ranks import RankInput
from memdoctor.errors import MemdoctorError, UsageError
from memdoctor.outputs import atomic_write, display_path
from memdoctor.report.plots_ranks import rank_bars
from memdoctor.report.render import REPORT_FILENAME, embed_json, environment
from memdoctor.report.summary import SUMMARY_FILENAME, build_summary, summary_json
from memdoctor.trace import PARTIAL_SUFFIX, TRACE_FILENAME, Trace, load_trace, paused_gc, unfinished_end
from memdoctor.version import __version__

RANKS_FILENAME = "ranks.json"
TEMPLATE = "ranks.html.j2"
RANK_FOLDER = re.compile(r"rank-(\d{1,6})")


def is_multi_rank(folder: Path) -> bool:
    """A multi-rank profile's folder: it holds ``ranks.json`` or a ``rank-K`` folder."""
    return folder.is_dir() and ((folder / RANKS_FILENAME).is_file() or bool(_rank_folders(folder)))


def rank_folders(out_dir: Path) -> dict[int, Path]:
    """Each rank's folder: the one ``ranks.json`` names for it (its trace's folder), else ``rank-K``."""
    return _folders(out_dir, read_launch(out_dir))


def _folders(out_dir: Path, launch: dict[str, Any] | None) -> dict[int, Path]:
    found = _rank_folders(out_dir)
    for rank, entry in (launch or {}).get("ranks", {}).items():
        found[rank] = _named_folder(out_dir, entry) or found.get(rank, out_dir / f"rank-{rank}")
    return found


def write_merged(out_dir: Path, dest: Path | None = None) -> dict[str, Path]:
    """Write the merged ``summary.json`` and ``report.html`` of the multi-rank folder ``out_dir`` into
    ``dest`` (default: ``out_dir`` itself); return their paths. A rank's freshly re-rendered files in
    ``dest/rank-K/`` are read before those in ``out_dir/rank-K/``. UsageError: no ranks to merge, or a
    ``ranks.json`` that cannot be used."""
    out_dir = Path(out_dir)
    dest = Path(dest) if dest is not None else out_dir
    summary = merged_summary(out_dir, dest)
    paths = {"summary": dest / SUMMARY_FILENAME, "report": dest / REPORT_FILENAME}
    atomic_write(paths["summary"], summary_json(summary))
    atomic_write(paths["report"], render_merged(summary))
    return paths


def merged_summary(out_dir: Path, dest: Path | None = None) -> dict[str, Any]:
    """The merged ``summary.json`` of ``out_dir`` (links relative to ``dest``, default ``out_dir``)."""
    dest = dest if dest is not None else out_dir
    launch = read_launch(out_dir)
    folders = _folders(out_dir, launch)
    if launch is None and not folders:
        where = display_path(out_dir)
        raise UsageError(
            f"{where}: no {RANKS_FILENAME} and no rank-K folder: not a multi-rank profile folder"
        )
    problems = [] if launch is not None else [f"no {RANKS_FILENAME}: ranks found from their rank-K folders"]
    inputs: dict[int, RankInput] = {}
    headers: dict[int, dict[str, Any] | None] = {}
    with paused_gc():
        for rank, folder in sorted(folders.items()):
            entry = (launch or {}).get("ranks", {}).get(rank)
            inputs[rank], headers[rank] = rank_input(out_dir, dest, rank, folder, entry)
    world = launch["world_size"] if launch is not None else _world_size(inputs, headers, problems)
    for rank in range(world):
        if rank not in inputs:
            inputs[rank] = RankInput(
                rank, f"rank-{rank}", problems=[f"nothing to read: no rank-{rank} folder"]
            )
    extra = sorted(k for k in inputs if k >= world)
    if extra:
        problems.append(f"folders of ranks {extra} left out: the run had {world} ranks")
    kept = [inputs[k] for k in range(world)]
    return merged.merged_summary(world, kept, launch, problems)


def read_launch(out_dir: Path) -> dict[str, Any] | None:
    """``ranks.json`` checked (``merged.launch_record``), or None when there is none."""
    path = out_dir / RANKS_FILENAME
    if not path.is_file():
        return None
    try:
        return merged.launch_record(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json's errors are ValueErrors
        raise UsageError(
            f"{display_path(path)}: cannot be used ({_one_line(exc)}); memdoctor profile --nproc-per-node "
            "writes it, and without it the rank-K folders are merged"
        ) from None


def rank_input(
    out_dir: Path, dest: Path, rank: int, folder: Path, entry: dict[str, Any] | None
) -> tuple[RankInput, dict[str, Any] | None]:
    """What one rank's folder holds, read: its trace (for its end, its collectives and its
    ``distributed`` header, returned beside), its summary (built from the trace when missing), its
    report's link. Every file that cannot be read is a line of ``problems``, never an exception."""
    name = folder.name if folder.parent.resolve() == out_dir.resolve() else os.path.relpath(folder, out_dir)
    inp = RankInput(rank, Path(name).as_posix(), launch=entry)
    if entry is not None and entry.get("trace") is not None and _named_folder(out_dir, entry) is None:
        inp.problems.append(
            f"{RANKS_FILENAME} names a trace outside {display_path(out_dir)}: read rank-{rank}/ instead"
        )
    trace = _load_trace(folder / TRACE_FILENAME, inp.problems)
    fresh = dest / inp.folder  # where a re-render of this rank (memdoctor report --each-rank) wrote
    places = [fresh, folder] if fresh.resolve() != folder.resolve() else [folder]
    inp.summary = _read_summary(places, inp.problems)
    if trace is not None:
        with trace.frozen():
            _from_trace(inp, trace)
    elif inp.summary is None:
        inp.problems.append("no summary.json and no readable trace: no figure for this rank")
    inp.report = _report_link(places, dest, inp.problems)
    return inp, (merged.distributed_of(trace.header) if trace is not None else None)


def _from_trace(inp: RankInput, trace: Trace) -> None:
    inp.end, inp.ended_unix = trace.end, merged.ended_unix(trace)
    inp.collectives = merged.collectives_per_step(trace)
    inp.collectives_note = "not measured: no step of its trace recorded collective calls"
    if inp.summary is None:
        if trace.end is None:
            trace.end = unfinished_end(sum(1 for s in trace.steps if s.complete))
        inp.summary = build_summary(trace)
        inp.problems.append("no readable summary.json: built from its trace")
    who = merged.distributed_of(trace.header)
    if who is not None and who["rank"] != inp.rank:
        inp.problems.append(f"its trace says it is rank {who['rank']}, its folder rank {inp.rank}")


def _load_trace(path: Path, problems: list[str]) -> Trace | None:
    """The rank's trace; one cut short (a rank killed mid-step, or only its ``.partial`` left) is read
    up to its last whole record and said so; an unreadable one is a problem line and None."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if not path.is_file() and partial.is_file():
        path = partial
    try:
        return load_trace(path)
    except MemdoctorError as exc:
        first = _one_line(exc)
    try:
        trace = load_trace(path, salvage=True)
    except MemdoctorError:
        problems.append(f"its trace cannot be read: {first}")
        return None
    problems.append(f"its trace {display_path(path)} was cut short: read up to its last whole record")
    return trace


def _read_summary(folders: list[Path], problems: list[str]) -> dict[str, Any] | None:
    for folder in folders:
        path = folder / SUMMARY_FILENAME
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(f"{display_path(path)} cannot be read ({_one_line(exc)})")
            continue
        if isinstance(data, dict):
            return data
        problems.append(f"{display_path(path)} is not a summary (not a JSON object)")
    return None


def _report_link(folders: list[Path], dest: Path, problems: list[str]) -> str | None:
    """The rank's report.html relative to the merged report (a link that works offline), or None."""
    for folder in folders:
        path = folder / REPORT_FILENAME
        if path.is_file():
            return Path(os.path.relpath(path.resolve(), dest.resolve())).as_posix()
    problems.append("no report.html")
    return None


def _rank_folders(out_dir: Path) -> dict[int, Path]:
    try:
        entries = list(out_dir.iterdir())
    except OSError:
        return {}
    found = {}
    for path in entries:
        match = RANK_FOLDER.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def _named_folder(out_dir: Path, entry: dict[str, Any]) -> Path | None:
    """The folder of the trace ``ranks.json`` names for a rank, when it lies inside ``out_dir`` (the
    file is untrusted: ``../`` out of the folder is not followed)."""
    trace = entry.get("trace")
    if not isinstance(trace, str) or not trace:
        return None
    folder = (out_dir / trace).parent
    inside = folder.resolve().is_relative_to(out_dir.resolve())
    return folder if inside and folder.resolve() != out_dir.resolve() else None


def _world_size(
    inputs: dict[int, RankInput], headers: dict[int, dict[str, Any] | None], problems: list[str]
) -> int:
    """Without ranks.json: the traces' ``distributed.world_size`` (the largest, when they disagree),
    else one more than the highest rank folder."""
    sizes = {h["world_size"] for h in headers.values() if h is not None}
    if len(sizes) > 1:
        problems.append(f"the traces disagree on the world size ({sorted(sizes)}): {max(sizes)} used")
    if not sizes:
        problems.append("no trace has a distributed header: the world size is the number of rank-K folders")
    return max(sizes) if sizes else max(inputs) + 1


def render_merged(summary: dict[str, Any]) -> str:
    """``report.html`` of the merged summary: the first screen, the per-rank table, the chart."""
    return (
        environment()
        .get_template(TEMPLATE)
        .render(
            s=summary,
            failed=merged.FAILED,
            balanced=merged.BALANCED,
            chart=rank_bars(summary["ranks"], summary["failed_first"], merged.FAILED),
            summary_json=embed_json(summary),
            memdoctor_version=__version__,
        )
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
