#!/bin/bash
# The bf16 tensor-core attention kernels (attention_tc.cu) compiled to PTX by nvcc for sm_80 and sm_90: every
# forward, dQ and dK/dV kernel (each head-dim instantiation) must contain the bf16 mma.sync instruction. The
# emulated ops test runs the tensor-core path on the CPU; this checks that nvcc really emits it for the GPUs. And
# the Gated DeltaNet kernels' resources (below).
# Skips (passes with a message) only where no nvcc is installed.
set -euo pipefail

nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
[[ -x "$nvcc" ]] || nvcc="$(command -v nvcc || true)"
if [[ -z "$nvcc" ]]; then
  echo "SKIPPED: no nvcc (neither /usr/local/cuda/bin/nvcc nor nvcc on PATH):" \
    "the PTX of the tensor-core kernels is not checked"
  exit 0
fi

cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
mma='mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32'
status=0
for arch in 80 90; do
  ptx="${TEST_TMPDIR}/attention_tc_sm${arch}.ptx"
  "$nvcc" -ptx -arch="sm_${arch}" --std=c++17 -I. -o "$ptx" kernels/cuda/attention_tc.cu
  # Per kernel entry: its name and the count of mma instructions in its body.
  counts="$(awk -v mma="$mma" '
    /\.entry / { if (name != "") print name, n; name = $0; sub(/^.*\.entry /, "", name); sub(/\(.*$/, "", name); n = 0 }
    index($0, mma) { n++ }
    END { if (name != "") print name, n }' "$ptx")"
  kernels=0
  for kind in TcForwardKernel TcDqKernel TcDkdvKernel; do
    for hd in 16 32 64 128 256; do
      line="$(grep -E "${kind}ILi${hd}E" <<<"$counts" || true)"
      if [[ -z "$line" ]]; then
        echo "FAIL sm_${arch}: no kernel ${kind}<${hd}> in the PTX"
        status=1
        continue
      fi
      n="${line##* }"
      kernels=$((kernels + 1))
      if [[ "$n" -eq 0 ]]; then
        echo "FAIL sm_${arch}: ${kind}<${hd}> has no ${mma}"
        status=1
      else
        echo "sm_${arch} ${kind}<${hd}>: ${n} x ${mma}"
      fi
    done
  done
  [[ "$kernels" -eq 15 ]] || status=1
done

# The Gated DeltaNet kernels (gated_delta.cu): every entry, for sm_80 and sm_90, keeps its state in registers (no
# stack frame, no spills), and the backward's registers fit its largest block (512 threads of 64K registers).
for arch in 80 90; do
  info="$("$nvcc" -cubin -arch="sm_${arch}" --std=c++17 -I. -Xptxas -v -o "${TEST_TMPDIR}/gd_sm${arch}.cubin" \
    kernels/cuda/gated_delta.cu 2>&1)"
  entries="$(grep -c "Compiling entry" <<<"$info" || true)"
  if [[ "$entries" -ne 6 ]]; then
    echo "FAIL sm_${arch}: ${entries} gated delta kernels, expected 6 (forward, backward, sum over heads; f32, f64)"
    status=1
  fi
  if grep -E "stack frame|spill" <<<"$info" | grep -vq "^ *0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"; then
    echo "FAIL sm_${arch}: a gated delta kernel uses local memory:"
    grep -E "entry|stack frame" <<<"$info"
    status=1
  fi
  regs="$(awk '/Compiling entry/ { backward = index($0, "GatedDeltaBackwardKernel") > 0 }
               backward && /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") print $(i + 1) }' \
          <<<"$info" | sort -n | tail -1)"
  if [[ -z "$regs" || $((regs * 512)) -gt 65536 ]]; then
    echo "FAIL sm_${arch}: the gated delta backward uses ${regs:-?} registers; 512 threads need <= 128"
    status=1
  else
    echo "sm_${arch} gated delta: ${entries} kernels without local memory, backward ${regs} registers"
  fi
done
exit "$status"
