"""Hostile traces against `memdoctor report`: time and peak memory for each (issue 19, point 4).

Builds each "bomb" of the issue in a scratch folder, runs `python -m memdoctor report FILE -o DIR` on it
as a child process, and prints one table row per case: what memdoctor answered (exit code and the first
line of stderr), the wall time, the child's CPU time and its peak resident memory (``os.wait4``'s
``ru_utime + ru_stime`` and ``ru_maxrss``).

    python benchmarks/trace_bombs.py                    # every case, the sizes of BENCHMARKS.md
    python benchmarks/trace_bombs.py --only steps --steps 20000
    python benchmarks/trace_bombs.py --json results.json

The sizes are those of the issue, except where noted in ``--help``; the files are built once per run
(the 3 GB file is sparse, so it costs no disk).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.tracebuilder import TraceBuilder, tiny_mlp  # noqa: E402

MiB, GiB = 1024**2, 1024**3


def _member(record: dict[str, Any]) -> bytes:
    line = json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    return gzip.compress(line, compresslevel=1, mtime=0)


def _base(steps: int = 3) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """A small valid run: (header, model and step records, end), to pad with a bomb."""
    b = TraceBuilder(kind="cpu")
    b.add_model(tiny_mlp())
    b.add_steps(warmup=1, profiled=steps)
    b.end("completed", "profiled")
    trace = b.build()
    recs = trace.records()
    return recs[0], recs[1:-1], recs[-1]


def baseline(path: Path) -> str:
    """A small valid run (1 warm-up and 3 steps of a 4-module model): the fixed cost of the command."""
    header, body, end = _base()
    with path.open("wb") as fh:
        for rec in [header, *body, end]:
            fh.write(_member(rec))
    return "a normal 4-step trace (the command's fixed cost)"


def newlines(path: Path, size: int) -> str:
    """A valid header, then one gzip member holding ``size`` bytes of newlines (about 1 MB per GiB)."""
    header, _, _ = _base()
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\n" * MiB
    with path.open("wb") as fh:
        fh.write(_member(header))
        for _ in range(size // MiB):
            fh.write(comp.compress(block))
        fh.write(comp.flush())
    return f"{size // MiB} MiB of newlines after a header ({path.stat().st_size / MiB:.1f} MiB on disk)"


def long_line(path: Path, size: int) -> str:
    """A valid header, then one line of ``size`` spaces and no newline."""
    header, _, _ = _base()
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    with path.open("wb") as fh:
        fh.write(_member(header))
        for _ in range(size // MiB):
            fh.write(comp.compress(b" " * MiB))
        fh.write(comp.flush())
    return f"one line of {size // MiB} MiB ({path.stat().st_size / MiB:.1f} MiB on disk)"


def members(path: Path, n: int) -> str:
    """A valid trace of ``n`` gzip members: header, model, steps, ``n`` tiny unknown records, end."""
    header, body, end = _base()
    with path.open("wb") as fh:
        for rec in [header, *body]:
            fh.write(_member(rec))
        tiny = _member({"type": "x"})
        fh.write(tiny * (n - len(body) - 2))
        fh.write(_member(end))
    return f"{n} gzip members ({path.stat().st_size / MiB:.1f} MiB)"


def not_gzip(path: Path, size: int) -> str:
    """A sparse file of ``size`` bytes that is no gzip file at all."""
    with path.open("wb") as fh:
        fh.truncate(size)
    return f"{size / 1e9:.0f} GB of zeros, not gzip (sparse)"


def steps(path: Path, n: int) -> str:
    """A valid trace with ``n`` profiled steps of a 4-module model: small records (no memory timeline)
    that carry gradient norms, so every per-step analysis (the exploding-gradient median) runs."""
    header, body, end = _base(steps=1)
    model, warm, step = body[0], body[1], body[2]
    cols = step["modules"]["0"]
    width = len(cols["calls"])
    step["timeline"] = {}
    with path.open("wb") as fh:
        for rec in (header, model, warm):
            fh.write(_member(rec))
        for i in range(1, n + 1):
            norms = [1.0 + (i * 31 + j) % 17 for j in range(width)]
            cols["grad_norm"], cols["grad_nonfinite"] = norms, [0] * width
            step["grad_norm"] = {"global": sum(norms), "nonfinite_modules": [], "first_nonfinite": None}
            step["step"] = i
            step["duration_ms"] = 10.0 + (i * 7919 % 1000) / 100
            fh.write(_member(step))
        fh.write(_member(dict(end, steps_recorded=n)))
    return f"{n} step records ({path.stat().st_size / MiB:.1f} MiB)"


def events(path: Path, n: int) -> str:
    """A valid trace with 3 steps and ``n`` event records (``note`` events, each its own message)."""
    header, body, end = _base()
    with path.open("wb") as fh:
        for rec in [header, *body]:
            fh.write(_member(rec))
        for i in range(n):
            fh.write(_member({"type": "event", "kind": "note", "message": f"event {i}", "t_unix": 1.7e9 + i}))
        fh.write(_member(end))
    return f"{n} events ({path.stat().st_size / MiB:.1f} MiB)"


def huge_numbers(path: Path, digits: int) -> str:
    """A valid trace whose step duration is an integer of ``digits`` digits."""
    header, body, end = _base()
    body[-1]["duration_ms"] = 10**digits
    with path.open("wb") as fh:
        for rec in [header, *body, end]:
            fh.write(_member(rec))
    return f"a {digits}-digit integer in a step"


def far_timestamp(path: Path, when: float) -> str:
    header, body, end = _base()
    with path.open("wb") as fh:
        for rec in [dict(header, created_unix=when), *body, end]:
            fh.write(_member(rec))
    return f"created_unix = {when:g}"


def run_report(trace: Path, out: Path) -> dict[str, Any]:
    """Run ``memdoctor report`` on ``trace``; its exit code, first stderr line, wall time and peak RSS."""
    load = os.getloadavg()[0]  # the machine's load as the case starts: these timings are wall times
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "memdoctor", "report", str(trace), "-o", str(out), "--force"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    report = out / "report.html"
    return {
        "rc": proc.returncode,
        "stderr": (err.strip().splitlines() or [""])[0][:160],
        "wall_s": round(wall, 2),
        # the child's own CPU time (user + system): on a shared machine, less sensitive to load than wall
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "report_mib": round(report.stat().st_size / MiB, 2) if report.exists() else None,
        "load_avg": round(load, 1),
    }


def cases(a: argparse.Namespace) -> Iterator[tuple[str, Callable[[Path], str]]]:
    yield "baseline", baseline
    yield "newlines", lambda p: newlines(p, a.newlines_mib * MiB)
    yield "long_line", lambda p: long_line(p, a.line_mib * MiB)
    yield "members", lambda p: members(p, a.members)
    yield "not_gzip", lambda p: not_gzip(p, a.not_gzip_gb * 10**9)
    yield "steps", lambda p: steps(p, a.steps)
    yield "events", lambda p: events(p, a.events)
    yield "digits", lambda p: huge_numbers(p, 400)
    yield "timestamp", lambda p: far_timestamp(p, 1e300)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--newlines-mib", type=int, default=1024, help="newlines bomb size (default 1 GiB)")
    ap.add_argument("--line-mib", type=int, default=1024, help="one-line bomb size (default 1 GiB)")
    ap.add_argument("--members", type=int, default=100_000)
    ap.add_argument("--not-gzip-gb", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--only", nargs="*", help="case names to run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memdoctor-bombs-") as tmp:
        for name, build in cases(a):
            if a.only and name not in a.only:
                continue
            path = Path(tmp) / f"{name}.jsonl.gz"
            t0 = time.monotonic()
            what = build(path)
            built = time.monotonic() - t0
            row = {
                "case": name,
                "input": what,
                "build_s": round(built, 1),
                **run_report(path, Path(tmp) / name),
            }
            path.unlink()
            rows.append(row)
            print(
                f"| {name} | {what} | {row['rc']} | {row['wall_s']} s | {row['cpu_s']} s | "
                f"{row['peak_rss_mib']} MiB | "
                f"{row['report_mib'] if row['report_mib'] is not None else '-'} | {row['load_avg']} | "
                f"{row['stderr']} |",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
