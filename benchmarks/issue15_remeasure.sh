#!/usr/bin/env bash
# Issue 15, point 7, on the device in one call (BENCHMARKS.md, "Issue 15 re-measured, session 8"):
# the 1.1B decoder's full-offload plan (profile, run, and a profile with the plan applied, whose ledger
# says what the device held), its hand configuration with the same engine, then the GPT-2 Trainer scenario
# (first shot and verified plan against a hand config). Everything under an 8 GiB cap.
# Usage: PYTHONPATH=$PWD bash benchmarks/issue15_remeasure.sh OUT   (OUT: at most 8 files come back)
set -u
out=${1:?OUT}; work=/tmp/i15; py=${PYTHON:-python3}
rm -rf "$work"; mkdir -p "$work/llama" "$out"
l=benchmarks/full_offload_llama.py
timeout 120 $py -m memdoctor profile --budget 8GiB -o "$work/llama/prof" --force $l -- --accelerate --steps 6 \
  > "$work/llama/profile.log" 2>&1; echo "llama profile rc=$?"
timeout 100 $py -m memdoctor run --config "$work/llama/prof/memdoctor.yaml" $l -- --accelerate --steps 8 \
  --timing-file "$work/llama/run-timing.jsonl" > "$work/llama/run.log" 2>&1; echo "llama run rc=$?"
timeout 80 $py $l --accelerate --memory-cap-gib 8 --hand-offload --hand-checkpoint --bf16 --steps 6 \
  --timing-file "$work/llama/hand-timing.jsonl" > "$work/llama/hand.log" 2>&1; echo "llama hand rc=$?"
timeout 120 $py -m memdoctor profile --budget 8GiB --config "$work/llama/prof/memdoctor.yaml" --steps 2 \
  -o "$work/llama/applied" --force $l -- --accelerate --steps 4 > "$work/llama/applied.log" 2>&1
echo "llama applied profile rc=$?"
(cd "$work/llama" && tar czf "$out/llama.tgz" --exclude='*.html' ./*.log ./*.jsonl prof/memdoctor.yaml \
  prof/summary.json applied/summary.json applied/trace.jsonl.gz 2>/dev/null)
timeout 280 $py benchmarks/story_scenario.py --workload gpt2-trainer --first-shot --out "$work/gpt2" \
  --timeout 200 --grid "bf16, gradient checkpointing" > "$out/gpt2.log" 2>&1; echo "gpt2 rc=$?"
cp "$work/gpt2/results.json" "$out/gpt2-results.json" 2>/dev/null
(cd "$work/gpt2" && tar czf "$out/gpt2.tgz" $(find . -name summary.json -o -name memdoctor.yaml -o -name output.txt) \
  b-profile/report/reprofile/trace.jsonl.gz b-profile/report/verify/trace.jsonl.gz 2>/dev/null)
grep -h "rc=\|memdoctor: \(verify\|reprofile\)" "$work"/llama/*.log | tail -20
tail -12 "$out/gpt2.log"
