"""Regenerate sample_reports/ from the traces recorded on the GPU (tests/data/gpu-*.jsonl.gz).

    python benchmarks/make_sample_reports.py

Each trace is rendered with the installed memdoctor into sample_reports/<name>/ (report.html and
summary.json), replacing what is there: these folders are generated, never edited by hand.
"""

from __future__ import annotations

from pathlib import Path

from memdoctor.report import write_report
from memdoctor.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    for trace_path in sorted((ROOT / "tests" / "data").glob("gpu-*.jsonl.gz")):
        name = trace_path.name.removesuffix(".jsonl.gz").removeprefix("gpu-")
        out = ROOT / "sample_reports" / name
        out.mkdir(parents=True, exist_ok=True)
        for path in write_report(load_trace(trace_path), out).values():
            print(f"Wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
