#!/bin/bash
# train --tp=2 --device=cuda under `mpirun -np 2` against one process on the GPU: per-step losses equal (fp64, 1e-10)
# for seco, streambp and full on `demo` (Llama GQA) and seco on `bench-ssm` (Mamba).
#   --dist=mpi:  both ranks may share one GPU (activations all-reduced through host copies; MPI is not CUDA-aware).
#   --dist=nccl: one GPU per rank (NCCL refuses two ranks of one communicator on one device), so it runs only where
#                nvidia-smi lists two or more GPUs, else prints SKIP for that part.
# Needs a train with the CUDA backend: built with --config=cuda (//distributed:train_tp_gpu_test, tag gpu), or
# //distributed:train_emulated_cuda (the CPU emulation, no GPU: //distributed:train_tp_emulated_cuda_test). Without a
# usable CUDA device the whole test prints SKIP and passes.
# Usage: train_tp_gpu_test.sh <path to train> [emulated]   (emulated: demo seco only, the emulation is slow)
set -uo pipefail
train="$1"; [[ "$train" == /* ]] || train="$(pwd)/$train"
cases=("demo seco" "demo streambp" "demo full" "bench-ssm seco")
[[ "${2:-}" == emulated ]] && cases=("demo seco")
skip() { echo "SKIP: $* (train --tp on cuda was not exercised)"; exit 0; }
fail() { echo "FAIL: $*"; exit 1; }
command -v mpirun >/dev/null 2>&1 || fail "mpirun is absent"
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
cd "${TEST_TMPDIR:-$(mktemp -d)}"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
same() {  # same <single.json> <tp.json> <what>
  /usr/bin/env python3 - "$@" <<'PY' || fail "$3: losses differ"
import json, sys
a = json.load(open(sys.argv[1]))["losses"]; b = json.load(open(sys.argv[2]))["losses"]
print(sys.argv[3], "one process", a); print(sys.argv[3], "tp=2       ", b)
assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
}
run_tp() {  # run_tp <dist> <name> args...
  local dist="$1" name="$2"; shift 2
  timeout --signal=KILL 600 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader -np 2 \
    "$train" --device=cuda --dist="$dist" --tp=2 "$@" --report="$name.json" >"$name.log" 2>&1
}
for case in "${cases[@]}"; do
  read -r model strategy <<<"$case"
  args=(--model="$model" --dtype=f64 --seq_len=560 --batch=2 --steps=3 --strategy="$strategy" --chunk=128)
  name="$model-$strategy"
  if ! "$train" --device=cuda "${args[@]}" --report="$name-single.json" >"$name-single.log" 2>&1; then
    cat "$name-single.log"
    grep -q -i "no usable CUDA device\|no CUDA device\|CUDA backend" "$name-single.log" && skip "no usable CUDA device"
    fail "$name: one process on cuda"
  fi
  run_tp mpi "$name-mpi" "${args[@]}" || { cat "$name-mpi.log"; fail "$name: mpirun -np 2 train --dist=mpi --tp=2"; }
  grep -q "tensor parallel: 2 ranks per group" "$name-mpi.log" || { cat "$name-mpi.log"; fail "$name: no tensor parallelism"; }
  same "$name-single.json" "$name-mpi.json" "$name --dist=mpi"
  if [[ "${gpus:-0}" -lt 2 ]]; then
    echo "SKIP $name --dist=nccl: ${gpus:-0} GPU(s) listed; NCCL needs one GPU per rank of a communicator"
    continue
  fi
  run_tp nccl "$name-nccl" "${args[@]}" || { cat "$name-nccl.log"; fail "$name: mpirun -np 2 train --dist=nccl --tp=2"; }
  same "$name-single.json" "$name-nccl.json" "$name --dist=nccl"
done
echo PASS
