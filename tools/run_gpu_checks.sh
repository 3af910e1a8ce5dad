#!/bin/bash
# The GPU checks of issue 8, from a bundle made by tools/gpu_bundle.sh (no Bazel needed). Writes logs and JSON to
# $1 (default: $OUT or ./gpu_results). Each step prints its own verdict; the script goes on after a failure.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-${OUT:-./gpu_results}}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
bin="$here/bin"
step() { local name="$1"; shift; echo "== $name: $*"; ( "$@" ) >"$out/$name.log" 2>&1; echo "   rc=$? ($out/$name.log)"; tail -3 "$out/$name.log"; }
nvidia-smi -L | tee "$out/gpu.txt"
step ops_test "$bin/ops_test"
step cuda_strategy_test "$bin/cuda_strategy_test"
if command -v compute-sanitizer >/dev/null 2>&1; then
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/ops_test"
elif [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
  step memcheck /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/ops_test"
fi
step train_device_test bash "$here/scripts/train_device_test.sh" "$bin/train" cuda
step train_nccl_gpu_test bash "$here/scripts/train_nccl_gpu_test.sh" "$bin/train"
step vocab_parallel_ops_test "$bin/vocab_parallel_ops_test"
# Tensor parallel on the GPU: mpirun -np 2 train --tp=2 --device=cuda = one process (--dist=mpi: both ranks on one
# GPU; --dist=nccl needs two GPUs, NCCL refusing two ranks of a communicator on one device).
step train_tp_gpu_test bash "$here/scripts/train_tp_gpu_test.sh" "$bin/train"
for s in seco streambp; do
  step "gradcheck_$s" "$bin/gradcheck" --device=cuda --model=tiny --dtype=f32 --strategy=$s --chunk=48 --page_size=16 --seq_len=256
done
# The 1B Llama shape in bf16 matmul: seqgrad (full, ckpt, seco) against HF transformers (SDPA; full, ckpt).
step bench_1b "$bin/bench" --device=cuda --matmul=bf16 --model=llama-1b-shape --strategies=full,ckpt,seco \
  --seq_lens=8192,16384,32768,65536,131072 --chunk=4096 --page_size=256 --repeats=2 --warmup=1 \
  --compare_torch --torch_script="$here/scripts/bench_torch_gpu.py" --json="$out/bench_1b.json"
# KV offload on the 7B shape: GPU memory growth per 10K tokens against seco without offload (then with sparse pages).
step bench_7b_offload "$bin/bench" --device=cuda --matmul=bf16 --model=qwen2.5-7b-shape --strategies=seco,seco:offload \
  --seq_lens=16384,32768,65536,131072 --chunk=4096 --repeats=1 --warmup=0 --json="$out/bench_7b_offload.json"
step bench_7b_offload_sparse "$bin/bench" --device=cuda --matmul=bf16 --model=qwen2.5-7b-shape \
  --strategies=seco:offload --sparse_pages=8 --seq_lens=16384,32768,65536,131072 --chunk=4096 --repeats=1 \
  --warmup=0 --json="$out/bench_7b_offload_sparse.json"
