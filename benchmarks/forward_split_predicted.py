"""Predicted against measured peaks of micro-batch splits, from one profile of the full batch.

Run by ``benchmarks/forward_split_check.sh``: given a ``memdoctor profile`` trace of a script's
full batch and the ``--peak-file`` JSONs of ``memdoctor run``s of it under ``accumulation_steps: k``
(split inside the forward: ``fwd-K.json``) and of the script's own loop over k micro-batches
(``loop-K.json``), print the allocated peak the memory model predicts for each split with and without
the forward's outputs (``joined_outputs``), beside the measured one.

    python benchmarks/forward_split_predicted.py TRACE PEAK_DIR [--ks 2,3,4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from memdoctor.plan.config import Config
from memdoctor.plan.model import predict, workload
from memdoctor.plan.splits import AS_BEFORE, Split
from memdoctor.report import build_summary
from memdoctor.trace import load_trace

ARGUMENTS = Split(
    "arguments", batch_option="--batch-size", batch_value=12, accumulation_option="--grad-accum"
)


def _measured(path: Path) -> int | None:
    if not path.exists():
        return None
    found = json.loads(path.read_text()).get("max_allocated_bytes")
    return int(found) if isinstance(found, (int, float)) else None


def rows(trace_path: Path, peaks: Path, ks: list[int]) -> list[dict[str, Any]]:
    trace = load_trace(trace_path)
    w = workload(trace, build_summary(trace))
    assert w is not None, "the trace has no memory figures"
    out: list[dict[str, Any]] = []
    for k in ks:
        for name, split, peak in (("forward", AS_BEFORE, "fwd"), ("loop", ARGUMENTS, "loop")):
            p = predict(dataclasses.replace(w, split=split), Config(accumulation_steps=k))
            joined = p.breakdown.get("joined_outputs", 0)
            measured = _measured(peaks / f"{peak}-{k}.json")
            out.append(
                {
                    "split": name,
                    "k": k,
                    "root_output_bytes": w.root_output_bytes,
                    "predicted": p.peak_bytes,
                    "predicted_without_outputs": p.peak_bytes - joined,
                    "measured": measured,
                    "error": None if not measured else round(p.peak_bytes / measured - 1, 4),
                    "error_without_outputs": None
                    if not measured
                    else round((p.peak_bytes - joined) / measured - 1, 4),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("peaks", type=Path)
    p.add_argument("--ks", default="2,3,4")
    args = p.parse_args()
    for row in rows(args.trace, args.peaks, [int(k) for k in args.ks.split(",")]):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
