#!/bin/bash
# --device and --matmul. Built without --config=cuda: --device=cuda is refused naming the build. Built with it:
# without a GPU, refused naming the missing device (the GPU part prints SKIP); with one, 3 steps on the GPU give
# the CPU's losses (f64 to 1e-9, f32 with --matmul=fp32 to 1e-4), and a sequence that cannot fit is refused before
# training with the numbers.
set -uo pipefail
train="$(pwd)/$1"
build="${2:-cpu}"
cd "${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # expect_error <pattern> <train args...>: exits non-zero and prints the pattern
  local pattern="$1"; shift
  if "$train" "$@" >out.log 2>&1; then cat out.log; fail "accepted: $*"; fi
  grep -q -- "$pattern" out.log || { cat out.log; fail "no '$pattern' for: $*"; }
}
small=(--model=tiny --seq_len=256 --steps=3 --chunk=64)
expect_error "--device: unknown device 'tpu' (choose cpu, cuda or meta)" "${small[@]}" --device=tpu
expect_error "--device=meta only plans memory" "${small[@]}" --device=meta
expect_error "--matmul: the CPU has no tf32 products" "${small[@]}" --matmul=tf32
if [[ "$build" == cpu ]]; then
  expect_error "built without the cuda backend (build with --config=cuda)" "${small[@]}" --device=cuda
  echo PASS
  exit 0
fi
if ! "$train" "${small[@]}" --device=cuda --steps=1 >probe.log 2>&1; then
  grep -Eq "no (usable )?CUDA device" probe.log || { cat probe.log; fail "--device=cuda failed without saying why"; }
  echo "SKIP (GPU part): $(grep -Eo 'no (usable )?CUDA device.*' probe.log | head -1)"
  echo PASS
  exit 0
fi
expect_error "--matmul" "${small[@]}" --device=cuda --matmul=fp8
for dtype_tol in "f64 1e-9 fp32" "f32 1e-4 fp32"; do
  read -r dtype tol matmul <<<"$dtype_tol"
  for strategy in full seco streambp; do
    args=("${small[@]}" --dtype=$dtype --strategy=$strategy)
    "$train" "${args[@]}" --report=cpu.json >cpu.log 2>&1 || { cat cpu.log; fail "cpu $strategy $dtype"; }
    "$train" "${args[@]}" --device=cuda --matmul=$matmul --report=gpu.json >gpu.log 2>&1 || { cat gpu.log; fail "gpu $strategy $dtype"; }
    TOL=$tol /usr/bin/python3 - <<'PY' || fail "$strategy $dtype: losses differ"
import json, os
a = json.load(open("cpu.json"))["losses"]; b = json.load(open("gpu.json"))["losses"]; tol = float(os.environ["TOL"])
print("cpu", a); print("gpu", b)
assert len(a) == len(b) == 3 and all(abs(x - y) <= tol * abs(x) for x, y in zip(a, b))
PY
  done
done
# 4M tokens of the 1B shape: its KV cache alone (16 layers x 4 KiB per token) is 256 GiB.
expect_error "does not fit on the GPU" --model=llama-1b-shape --seq_len=4000000 --steps=1 --device=cuda --strategy=seco
echo PASS
