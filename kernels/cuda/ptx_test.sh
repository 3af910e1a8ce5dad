#!/bin/bash
# The bf16 tensor-core attention kernels (attention_tc.cu) compiled to PTX by nvcc for sm_80 and sm_90: every
# forward, dQ and dK/dV kernel (each head-dim instantiation) must contain the bf16 mma.sync instruction. The
# emulated ops test runs the tensor-core path on the CPU; this checks that nvcc really emits it for the GPUs. And
# the Gated DeltaNet, Mamba-2 SSD and mixture-of-experts kernels' resources (below).
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

# Compiles kernels/cuda/$2.cu for sm_$1 with ptxas's resource report into $info; fails unless it has $4 entries
# ($3: what they are), none with a stack frame or spills (their state stays in registers).
compile_without_local_memory() {
  local arch="$1" file="$2" what="$3" expected="$4" entries
  info="$("$nvcc" -cubin -arch="sm_${arch}" --std=c++17 -I. -Xptxas -v -o "${TEST_TMPDIR}/${file}_sm${arch}.cubin" \
    "kernels/cuda/${file}.cu" 2>&1)"
  entries="$(grep -c "Compiling entry" <<<"$info" || true)"
  if [[ "$entries" -ne "$expected" ]]; then
    echo "FAIL sm_${arch}: ${entries} ${file}.cu kernels, expected ${expected} (${what})"
    status=1
  fi
  if grep -E "stack frame|spill" <<<"$info" | grep -vq "^ *0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"; then
    echo "FAIL sm_${arch}: a ${file}.cu kernel uses local memory:"
    grep -E "entry|stack frame" <<<"$info"
    status=1
  fi
}

# The most registers an entry of $info whose name contains $1 uses.
max_registers() {
  awk -v name="$1" '/Compiling entry/ { match_ = index($0, name) > 0 }
                    match_ && /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") print $(i + 1) }' \
    <<<"$info" | sort -n | tail -1
}

# A scan's kernels ($2.cu: $3, $4 entries) for sm_$1: no local memory, and the registers of its backward kernels
# (the entries whose names contain $5) fit their largest block (512 threads of 64K registers).
check_scan() {
  local arch="$1" file="$2" what="$3" expected="$4" kernel="$5" regs
  compile_without_local_memory "$arch" "$file" "$what" "$expected"
  regs="$(max_registers "$kernel")"
  if [[ -z "$regs" || $((regs * 512)) -gt 65536 ]]; then
    echo "FAIL sm_${arch}: a ${kernel} kernel uses ${regs:-?} registers; 512 threads need <= 128"
    status=1
  else
    echo "sm_${arch} ${file}: no local memory, ${kernel} kernels at most ${regs} registers"
  fi
}

# The Gated DeltaNet kernels (gated_delta.cu) and Mamba-2's SSD scan (ssd.cu).
for arch in 80 90; do
  check_scan "$arch" gated_delta "forward, backward, sum over heads; f32, f64" 6 GatedDeltaBackwardKernel
  check_scan "$arch" ssd "forward, backward, backward by pairs; f32, f64" 6 SsdBackward
done

# The mixture-of-experts kernels (moe.cu): no local memory, and every kernel's registers fit its block (at most 256
# threads).
for arch in 80 90; do
  compile_without_local_memory "$arch" moe "route, its backward, gather, scatter-add, row dots; f32, f64" 10
  regs="$(max_registers Kernel)"
  if [[ -z "$regs" || $((regs * 256)) -gt 65536 ]]; then
    echo "FAIL sm_${arch}: a mixture-of-experts kernel uses ${regs:-?} registers; 256 threads need <= 256"
    status=1
  else
    echo "sm_${arch} mixture of experts: no local memory, at most ${regs} registers"
  fi
done
exit "$status"
