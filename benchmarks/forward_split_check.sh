#!/usr/bin/env bash
# The minimal GPT's peaks under each micro-batch split, measured and predicted (issue 15, point 7):
# one profile of the full batch, then for each k a `memdoctor run` split inside the forward and the
# script's own loop over k micro-batches, each writing its peak; benchmarks/forward_split_predicted.py
# then sets the memory model's predictions beside them.
#   benchmarks/forward_split_check.sh OUT [PYTHON] [extra mini_gpt args, e.g. --tiny]
set -u
out=$1; py=${2:-python}; shift; shift || true
script=benchmarks/workloads/mini_gpt.py
batch=12; [[ " $* " == *" --tiny "* ]] && batch=4
mkdir -p "$out/peaks"
"$py" -m memdoctor profile -o "$out/prof" --force --warmup 1 --steps 2 "$script" -- --steps 4 "$@" >"$out/profile.log" 2>&1
for k in 2 3 4; do
  (( batch % k )) && continue
  printf 'memdoctor_config: 1\naccumulation_steps: %s\naccumulation_split: forward\n' "$k" >"$out/fwd-$k.yaml"
  "$py" -m memdoctor run --config "$out/fwd-$k.yaml" "$script" -- --steps 4 --peak-file "$out/peaks/fwd-$k.json" "$@" >>"$out/runs.log" 2>&1
  "$py" "$script" --steps 4 --batch-size $((batch / k)) --grad-accum "$k" --peak-file "$out/peaks/loop-$k.json" "$@" >>"$out/runs.log" 2>&1
done
PYTHONPATH=. "$py" benchmarks/forward_split_predicted.py "$out/prof/trace.jsonl.gz" "$out/peaks"
