#!/bin/bash
# --dist=nccl (host-staged NCCL, distributed/host_staged_nccl.h) under `mpirun -np 1` on one GPU: the per-step
# losses equal one process's (fp64, to 1e-10). Needs a train built with --config=cuda. Without a GPU (nvidia-smi
# absent, no GPU listed, or CUDA sees no device) it prints SKIP and passes.
# Usage: train_nccl_gpu_test.sh <path to train>   (bazel test --config=cuda //cli:train_nccl_gpu_test)
set -uo pipefail
train="$1"; [[ "$train" == /* ]] || train="$(pwd)/$train"
skip() { echo "SKIP: $* (the --dist=nccl path was not exercised)"; exit 0; }
fail() { echo "FAIL: $*"; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 || skip "no GPU: nvidia-smi is absent"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[[ "${gpus:-0}" -gt 0 ]] || skip "no GPU: nvidia-smi lists none"
command -v mpirun >/dev/null 2>&1 || fail "mpirun is absent (the NCCL unique id is broadcast over MPI)"
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
cd "${TEST_TMPDIR:-$(mktemp -d)}"
args=(--model=tiny --dtype=f64 --seq_len=560 --batch=2 --steps=3 --strategy=seco --chunk=128)
"$train" "${args[@]}" --report=single.json >single.log 2>&1 || { cat single.log; fail "single process"; }
timeout --signal=KILL 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 1 \
  "$train" --dist=nccl "${args[@]}" --report=nccl.json >nccl.log 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  cat nccl.log
  grep -q "needs a CUDA device" nccl.log && skip "no GPU: CUDA found no usable device (cudaGetDeviceCount)"
  grep -q "built without --config=cuda" nccl.log && fail "$train was built without --config=cuda"
  fail "mpirun -np 1 train --dist=nccl (rc $rc)"
fi
grep -q "data parallel: 1 ranks (nccl)" nccl.log || { cat nccl.log; fail "NCCL was not used"; }
/usr/bin/env python3 - <<'PY' || fail "losses differ"
import json
a = json.load(open("single.json"))["losses"]; b = json.load(open("nccl.json"))["losses"]
print("single", a); print("nccl, 1 rank", b)
assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
echo PASS
