"""Regenerate sample_reports/ from the recorded traces: those recorded on the GPU (tests/data/gpu-*.jsonl.gz)
and the multi-rank folders of ``RANK_SAMPLES`` (CPU gloo ranks, benchmarks/rank_accuracy.py).

    python benchmarks/make_sample_reports.py

Each trace is rendered with the installed memdoctor into sample_reports/<name>/ (report.html and
summary.json), replacing what is there: these folders are generated, never edited by hand. A
multi-rank folder is rendered as ``memdoctor report FOLDER --each-rank -o sample_reports/<name>
--force`` does: each rank's report into rank-K/, then the merged report beside them.
"""

from __future__ import annotations

from pathlib import Path

from memdoctor.cli import main as memdoctor
from memdoctor.report import write_report
from memdoctor.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
# Recorded multi-rank folders (tests/data/cpu-<name>) rendered as samples, as sample_reports/<name>.
RANK_SAMPLES = ("transformer-b16-fsdp2-2ranks",)


def main() -> None:
    for trace_path in sorted(DATA.glob("gpu-*.jsonl.gz")):
        name = trace_path.name.removesuffix(".jsonl.gz").removeprefix("gpu-")
        out = ROOT / "sample_reports" / name
        out.mkdir(parents=True, exist_ok=True)
        for path in write_report(load_trace(trace_path), out).values():
            print(f"Wrote {path.relative_to(ROOT)}")
    for name in RANK_SAMPLES:
        out = ROOT / "sample_reports" / name
        if memdoctor(["report", str(DATA / f"cpu-{name}"), "--each-rank", "-o", str(out), "--force"]) != 0:
            raise SystemExit(f"memdoctor report tests/data/cpu-{name} failed")


if __name__ == "__main__":
    main()
