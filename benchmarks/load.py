"""Under load (issue 6): profile a 1,000-module model for 50 steps on the CPU, then render its report.

    python benchmarks/load.py [--modules 1000] [--steps 50]

Prints the trace size, the profiling wall time, the peak RSS of this process, and how long rendering
the report from the trace takes (the issue's targets: trace under 20 MB, report under 10 s on the
2-core development machine).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from memdoctor.capture.session import ProfileSession
from memdoctor.report import write_report
from memdoctor.trace import TraceWriter, load_trace, make_header


def build(modules: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(modules // 2):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.modules)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = Path(tempfile.mkdtemp(prefix="memdoctor-load-"))
    writer = TraceWriter(out / "trace.jsonl.gz")
    writer.write(make_header(settings={"warmup": 1, "steps": args.steps - 1, "budget_bytes": None}))
    t0 = time.perf_counter()
    with ProfileSession(steps=args.steps - 1, warmup=1, sink=writer.write) as session:
        for _ in range(args.steps + 1):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            if session._done:
                break
    writer.write({"type": "end", "status": "completed", "message": "in-process run", "exit_code": 0})
    writer.close()
    profile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trace = load_trace(out / "trace.jsonl.gz")
    paths = write_report(trace, out)
    render_s = time.perf_counter() - t1
    size = (out / "trace.jsonl.gz").stat().st_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"modules {sum(1 for _ in model.modules())}  steps {len(trace.steps)}  trace {size / 2**20:.2f} MiB  "
        f"profiling {profile_s:.1f} s  load+render {render_s:.1f} s  report "
        f"{paths['report'].stat().st_size / 2**20:.2f} MiB  peak RSS {rss:.0f} MiB  ({out})"
    )


if __name__ == "__main__":
    main()
