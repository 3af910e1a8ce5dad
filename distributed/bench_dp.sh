#!/bin/bash
# Data-parallel scaling on CPU: 1 rank x 1 thread at --batch=B against 2 ranks x 1 thread at --batch=2B (the same
# per-rank batch), on the train binary. Prints seconds per step of each, their ratio (1.0 = communication fully
# hidden or free) and the bytes all-reduced per rank per step.
#   ./bazelw run //distributed:bench_dp -- [--model=demo --seq_len=4096 --steps=20 --batch=1 (per rank) ...]
set -euo pipefail
train="$(pwd)/$1"; shift
model=demo seq_len=4096 steps=20 batch=1 extra=()
for a in "$@"; do
  case "$a" in
    --model=*) model="${a#*=}" ;; --seq_len=*) seq_len="${a#*=}" ;; --steps=*) steps="${a#*=}" ;;
    --batch=*) batch="${a#*=}" ;; *) extra+=("$a") ;;
  esac
done
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
args=(--model="$model" --seq_len="$seq_len" --steps="$steps" "${extra[@]}")
"$train" "${args[@]}" --batch="$batch" --report="$dir/one.json" >"$dir/one.log" 2>&1 || { cat "$dir/one.log"; exit 1; }
mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -np 2 \
  "$train" --dist=mpi "${args[@]}" --batch=$((2 * batch)) --report="$dir/two.json" >"$dir/two.log" 2>&1 ||
  { cat "$dir/two.log"; exit 1; }
bytes=$(grep -o "[0-9]* bytes all-reduced per rank per step" "$dir/two.log" | cut -d' ' -f1)
/usr/bin/python3 - "$dir" "$batch" "$seq_len" "$bytes" <<'PY'
import json, sys
d, batch, seq_len, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
one = json.load(open(d + "/one.json")); two = json.load(open(d + "/two.json"))
t1 = batch * seq_len / one["tokens_per_s"]; t2 = 2 * batch * seq_len / two["tokens_per_s"]
print(f"1 rank  x 1 thread, batch {batch}:   {t1:.3f} s/step")
print(f"2 ranks x 1 thread, batch {2*batch}:   {t2:.3f} s/step")
print(f"time ratio (2 ranks / 1 rank): {t2 / t1:.3f}")
print(f"all-reduced per rank per step: {nbytes} bytes ({nbytes / 1048576:.2f} MiB)")
PY
