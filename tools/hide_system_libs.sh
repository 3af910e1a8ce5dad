#!/bin/bash
# Runs a command with this build machine's non-glibc libraries hidden from the dynamic loader, as on a machine that
# never had them: inside a private mount namespace, /dev/null is bind-mounted over every Abseil, OpenBLAS,
# BLAS/LAPACK, oneDNN, OpenCL, libgomp, libgfortran and libquadmath file, so loading one fails ("file too short")
# unless a bundled copy is found first; with SG_HIDE_CUDA=1 also the CUDA toolkit's cuBLAS, NCCL and CUDA runtime.
# Needs root or unprivileged user namespaces.
# usage: hide_system_libs.sh COMMAND [ARG...]
set -euo pipefail
if [[ "${SG_LIBS_HIDDEN:-}" != 1 ]]; then
  userns=()
  [[ "$(id -u)" == 0 ]] || userns=(--user --map-root-user)
  exec unshare "${userns[@]}" --mount env SG_LIBS_HIDDEN=1 "$0" "$@"
fi
shopt -s nullglob
hidden=0
for f in /usr/lib/x86_64-linux-gnu/{libabsl_,libopenblas,libblas,liblapack,libdnnl,libOpenCL,libgomp,libgfortran,libquadmath}*.so* \
         /usr/lib/x86_64-linux-gnu/openblas*/*.so*; do
  [[ -f "$f" ]] || continue
  mount --bind /dev/null "$f"
  hidden=$((hidden + 1))
done
if [[ "${SG_HIDE_CUDA:-}" == 1 ]]; then  # also the machine's CUDA libraries (a wheel that brings NVIDIA's)
  for f in /usr/local/cuda*/{lib,lib64,targets/x86_64-linux/lib}/{libcublas,libcublasLt,libnccl,libcudart}*.so*; do
    [[ -f "$f" && ! -L "$f" ]] || continue
    mount --bind /dev/null "$f"
    hidden=$((hidden + 1))
  done
fi
(( hidden > 0 )) || { echo "hide_system_libs.sh: found no library to hide" >&2; exit 1; }
exec "$@"
