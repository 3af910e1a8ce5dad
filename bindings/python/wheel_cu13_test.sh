#!/bin/bash
# The CUDA wheel (seqgrad-cu13) in a fresh venv: NVIDIA's cuBLAS and NCCL wheels beside it (as pip installs them),
# the machine's CUDA toolkit libraries and Debian's copies of the bundled ones hidden (tools/hide_system_libs.sh with
# SG_HIDE_CUDA=1). It loads cuBLAS from site-packages/nvidia, trains on the CPU, and a "cuda" model either trains
# (a machine with a GPU) or is refused with CUDA's reason; its console script's train likewise.
# usage: wheel_cu13_test.sh WHEEL NUMPY2_DIR HIDE_SYSTEM_LIBS PYTHON NVIDIA_DIR...  (PYTHON: the CPython the wheel
#   is for; NVIDIA_DIR: pip --target installs of NVIDIA's wheels, made by ./bazelw)
set -euo pipefail
whl="$(readlink -f "$1")"
numpy2="$2"
hide="$(readlink -f "$3")"
python="$4"
shift 4
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

tag="$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
if [[ "$(basename "$whl")" != seqgrad_cu13-*-$tag-$tag-manylinux_*_x86_64.whl ]]; then
  echo "FAIL: $(basename "$whl") is not a seqgrad_cu13 manylinux wheel" >&2
  exit 1
fi
if /usr/bin/python3 -m zipfile -l "$whl" | grep -E "lib(cublas|cublasLt|nccl)[^/]*\.so" >&2; then
  echo "FAIL: the wheel bundles NVIDIA's libraries instead of requiring their wheels" >&2
  exit 1
fi

"$python" -m venv "$tmp/venv"
site="$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')"
echo "$numpy2" >"$site/numpy2.pth"
for dir in "$@"; do cp -rs "$dir"/* "$site"/; done  # NVIDIA's wheels, installed (as links to their files)
# pip checks Requires-Dist (numpy, nvidia-cublas, nvidia-nccl-cu13) against those (offline).
"$tmp/venv/bin/python" -m pip install --quiet --no-index "$whl"

cat >"$tmp/check.py" <<'PY'
import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import seqgrad

requires = importlib.metadata.requires("seqgrad-cu13")
assert [r for r in requires if r.startswith("nvidia-cublas")] and [r for r in requires if r.startswith("nvidia-nccl")]
site = os.path.dirname(os.path.dirname(seqgrad.__file__))
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
cublas = [p for p in maps if os.path.basename(p).startswith("libcublas")]
# NVIDIA's wheel's copies (/proc shows the files the site-packages links point to), not the toolkit's.
assert cublas and all("/nvidia/cu13/lib/" in p and not p.startswith("/usr/") for p in cublas), cublas

with seqgrad.Model.from_preset("tiny", dtype="f64", seed=1) as model, seqgrad.Trainer(model) as trainer:
    cpu = trainer.step([[1, 2, 3, 4, 5, 6]])["loss"]
assert np.isfinite(cpu)
gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0 if os.path.exists(
    "/usr/bin/nvidia-smi") else False
try:
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=1, device="cuda") as model, seqgrad.Trainer(model) as t:
        on_gpu = t.step([[1, 2, 3, 4, 5, 6]])["loss"]
    assert gpu, "a cuda model ran without a GPU"
    assert abs(on_gpu - cpu) <= 1e-10 * abs(cpu), (on_gpu, cpu)
    print("cuda: loss", on_gpu, "cpu", cpu)
except seqgrad.SeqgradError as e:
    assert not gpu, e
    assert "cuda" in str(e), e
    print("no GPU here; device='cuda' says:", e)
print("seqgrad-cu13", seqgrad.version(), "cpu loss", cpu, "cuBLAS from", cublas)
PY
cd /
SG_HIDE_CUDA=1 "$hide" "$tmp/venv/bin/python" "$tmp/check.py"

# The console script's tools (CUDA builds) start and train on the CPU with the same libraries.
cd "$tmp"
SG_HIDE_CUDA=1 "$hide" "$tmp/venv/bin/seqgrad" train --model=tiny --steps=1 --seq_len=600 --threads=1 >"$tmp/cpu.txt"
grep -q "^done: 1 steps" "$tmp/cpu.txt" || { echo "FAIL: seqgrad train on the CPU: $(cat "$tmp/cpu.txt")" >&2; exit 1; }
if ! nvidia-smi -L >/dev/null 2>&1; then
  if SG_HIDE_CUDA=1 "$hide" "$tmp/venv/bin/seqgrad" train --model=tiny --steps=1 --seq_len=600 --device=cuda \
      >/dev/null 2>"$tmp/err.txt"; then
    echo "FAIL: train --device=cuda ran without a GPU" >&2
    exit 1
  fi
  grep -q "cuda" "$tmp/err.txt" || { echo "FAIL: train --device=cuda: $(cat "$tmp/err.txt")" >&2; exit 1; }
  echo "train --device=cuda without a GPU: $(tail -1 "$tmp/err.txt")"
fi
