"""How the time of ``memdoctor report`` on a long trace divides: load, summary, report (issue 19, point 4:
"100,000 steps are summarised in seconds"), at several step counts to show it is near-linear.

    python benchmarks/summary_scaling.py 25000 50000 100000

Each count: a trace of that many step records (``benchmarks/trace_bombs.steps``), loaded with
``load_trace``, summarised with ``build_summary`` and rendered with ``write_report``, the cyclic GC paused
and the trace frozen as ``memdoctor report`` does; wall seconds of each part, and the process's peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_bombs import steps

from memdoctor.report import build_summary, write_report
from memdoctor.trace import load_trace
from memdoctor.trace.reader import paused_gc


def one(n: int, work: Path) -> dict[str, float | int]:
    path = work / f"steps-{n}.jsonl.gz"
    steps(path, n)
    t0 = time.perf_counter()
    with paused_gc():
        trace = load_trace(path)
        t1 = time.perf_counter()
        with trace.frozen():
            summary = build_summary(trace)
            t2 = time.perf_counter()
            (work / f"out-{n}").mkdir()
            write_report(trace, work / f"out-{n}", summary)
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "steps": n,
        "load_s": round(t1 - t0, 2),
        "summary_s": round(t2 - t1, 2),
        "report_s": round(t3 - t2, 2),
        "peak_rss_bytes": rss,
    }


def main() -> None:
    counts = [int(a) for a in sys.argv[1:]] or [25_000, 50_000, 100_000]
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            print(json.dumps(one(n, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
