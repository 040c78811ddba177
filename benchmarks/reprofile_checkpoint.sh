#!/usr/bin/env bash
# The checkpointed re-profile on a GPU (docs/planner.md): the script of benchmarks/workloads/nosplit_blocks.py
# profiled without a cap (the truth) and under a cap it dies under; prints the truth's peak, the peak the
# plan rebuilt from the checkpointed re-profile, and --verify's measured peak of the plan.
# Usage: bash benchmarks/reprofile_checkpoint.sh [OUT] [BUDGET]
set -u
out=${1:-/tmp/ckall}; budget=${2:-1200MiB}
py=${PYTHON:-python3}
rm -rf "$out"; mkdir -p "$out"
$py -m memdoctor profile --warmup 1 --steps 2 -o "$out/truth" benchmarks/workloads/nosplit_blocks.py > "$out/truth.log" 2>&1
$py -m memdoctor profile --warmup 1 --steps 2 --budget "$budget" --verify -o "$out/capped" \
  benchmarks/workloads/nosplit_blocks.py > "$out/capped.log" 2>&1
$py - "$out" <<'PY'
import json, sys
from pathlib import Path
from memdoctor.trace import load_trace
from memdoctor.plan.model import workload, predict
from memdoctor.plan.config import Config
out = Path(sys.argv[1])
truth = json.loads((out / "truth/summary.json").read_text())
capped = json.loads((out / "capped/summary.json").read_text())
w = workload(load_trace(out / "capped/trace.jsonl.gz"), capped)
rp, plan, ver = capped.get("reprofile") or {}, capped.get("plan") or {}, capped.get("verified") or {}
print(json.dumps({
    "truth_peak_bytes": truth["peak_memory_bytes"],
    "truth_reserved_bytes": (truth.get("allocator") or {}).get("max_reserved"),
    "rebuilt_peak_bytes": w.peak_bytes if w else None,
    "rebuilt_as_is_predicted": predict(w, Config()).peak_bytes if w else None,
    "reprofile": {k: rp.get(k) for k in ("method", "why_no_split", "checkpointed", "used_round", "stopped")},
    "plan_config": plan.get("config"),
    "plan_predicted_peak_bytes": plan.get("predicted_peak_bytes"),
    "verified": {k: ver.get(k) for k in ("fits", "measured_peak_bytes", "predicted_peak_bytes", "status")},
}, indent=1))
PY
