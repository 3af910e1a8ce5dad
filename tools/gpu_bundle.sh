#!/bin/bash
# Builds //tools/gpu:bundle with --config=cuda (tools/gpu_check.sh, the CUDA binaries it runs, stripped, and the
# non-CUDA shared libraries they load, in one .tar.xz: tools/gpu/make_bundle.py) and copies it to
# gpu_bundle.tar.xz (git-ignored), for a GPU machine that has CUDA but no Bazel:
#   tools/gpu_bundle.sh                                                   # here
#   device run, carry=["gpu_bundle.tar.xz"]:                              # there; results in $OUT
#     tar xJf gpu_bundle.tar.xz && gpu_bundle/gpu_check.sh
# (without xz there: python3 -m tarfile -e gpu_bundle.tar.xz . && gpu_bundle/gpu_check.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./bazelw build --config=cuda //tools/gpu:bundle
cp -f bazel-bin/tools/gpu/bundle.tar.xz gpu_bundle.tar.xz
chmod u+w gpu_bundle.tar.xz
echo "gpu_bundle.tar.xz: $(du -b gpu_bundle.tar.xz | cut -f1) bytes"
