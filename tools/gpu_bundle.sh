#!/bin/bash
# Builds the CUDA binaries here (--config=cuda) and packs them, with the non-CUDA shared libraries they need and
# the GPU check scripts, into gpu_bundle/ (git-ignored) for a GPU machine that has CUDA but no Bazel:
#   tools/gpu_bundle.sh                       # here
#   device run, carry=["gpu_bundle"]:  gpu_bundle/run_gpu_checks.sh [out_dir]   # there
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
targets=(//examples:train //examples:bench //examples:gradcheck //kernels/cuda:ops_test //core:cuda_strategy_test
         //kernels/cuda:vocab_parallel_ops_test)
./bazelw build --config=cuda "${targets[@]}"
out=gpu_bundle
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib" "$out/scripts"
for t in "${targets[@]}"; do
  name="${t##*:}"; pkg="${t#//}"; pkg="${pkg%%:*}"
  # --define does not change the output directory: find the binary the cuda build just wrote.
  bin=$(ls -t bazel-out/*/bin/"$pkg/$name" | head -1)
  cp "$bin" "$out/bin/$name"
done
# Shared libraries from Debian packages (absl, OpenBLAS, gomp, ...) that a GPU image may lack; CUDA's own come
# from the GPU machine (/usr/local/cuda/lib64).
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -v -E '/usr/local/cuda|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|ld-linux|libcuda\.so' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$out/lib/"; done
cp examples/bench_torch_gpu.py examples/train_device_test.sh examples/train_nccl_gpu_test.sh \
  distributed/train_tp_gpu_test.sh "$out/scripts/"
cp tools/run_gpu_checks.sh "$out/run_gpu_checks.sh"
du -sh "$out"
