#!/usr/bin/env bash
# The checks of the CUDA backend on a lent GPU, from the bundle tools/gpu_bundle.sh makes (no Bazel there). Four
# stages by priority, each with its own time budget (seconds; 430 in all, so that a fix and a rerun fit a 15-minute
# loan); a stage left with no time is recorded as skipped, and a failed check never stops the run:
#   correctness  60  nvidia-smi, libraries, ops_test, cuda_strategy_test (every exact strategy vs full and vs the
#                    CPU: f32 within max(1e-5, 2x the CPU's own f32 error; Mamba 2e-5), f64 1e-10),
#                    bf16_strategy_test (loss within 1e-2 of f64's and the CPU's; gradients off f64 by <= 3x the
#                    CPU's bf16 error + 2e-2, off bf16 full by <= 2x full's error + 1e-2), gradcheck seco and
#                    streambp in f64 (1e-10)
#   speed       170  llama-1b-shape, bf16 weights and matmuls: seqgrad full and seco at 8K and 32K against PyTorch
#                    + transformers (SDPA; full and gradient checkpointing): tok/s, MFU, peak memory (each engine's
#                    own, and the GPU's used memory sampled by nvidia-smi)
#   memory      130  qwen2.5-7b-shape, seco with KV offload and LoRA at 16K and 32K: device growth per 10K tokens
#                    (engine-accounted and nvidia-smi's) against the meta plan (cli/plan)
#   extras       70  compute-sanitizer memcheck of ops_test, racecheck and initcheck of the loss kernels (whose
#                    summed loss varied by one ulp between identical calls on an H200); the five most expensive
#                    kernels of one seco step
# Every check writes <name>.log (and its tool's JSON) to the output folder; checks.jsonl has one line per check as
# it ends; summary.json has every stage's status, the checks, and the speed and memory tables. Where $OUT is set (a
# lent machine's folder of files to return, which takes few files), summary.json, checks.jsonl and the whole folder
# as gpu_results.tar.gz are copied there at the end.
#
# usage: gpu_check.sh [--out DIR] [--budget_s S] [--tiny]
#   --out       output folder (default ./gpu_results)
#   --budget_s  seconds in all (default 430); stages past it are skipped
#   --tiny      tiny shapes and test subsets, no GPU tools needed: the emulated bundle's run
#               (//tools/gpu:check_emulated_test), which checks this script without a GPU
# Exit status: 0 when every check that ran passed, 1 otherwise.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out=./gpu_results budget_s=430 tiny=0
while (($#)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#*=}"; shift ;;
    --budget_s) budget_s="$2"; shift 2 ;;
    --budget_s=*) budget_s="${1#*=}"; shift ;;
    --tiny) tiny=1; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (--out DIR, --budget_s S, --tiny)" >&2; exit 2 ;;
  esac
done
[[ "$budget_s" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget_s must be a whole number of seconds" >&2; exit 2; }
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
bin="$here/bin"
: >"$out/checks.jsonl"
: >"$out/stages.jsonl"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export TEST_TMPDIR="$work"  # the gtest binaries write their scratch files there, as under Bazel
run_start=$SECONDS run_end=$((SECONDS + budget_s))
python="$(command -v python3 || true)"
# Logs written as they come, so that a check killed at its cap leaves what it printed.
line_buffered="$(command -v stdbuf >/dev/null && echo "stdbuf -oL -eL")"

# --- JSON lines -----------------------------------------------------------------------------------------------------
json_str() {
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\n'/ }"
  s="${s//$'\t'/ }"
  printf '"%s"' "$s"
}

# record NAME STATUS RC SECONDS REASON: one line of checks.jsonl.
record() {
  printf '{"stage": %s, "check": %s, "status": %s, "rc": %s, "elapsed_s": %s, "reason": %s, "log": %s}\n' \
    "$(json_str "$stage")" "$(json_str "$1")" "$(json_str "$2")" "${3:-null}" "${4:-0}" "$(json_str "$5")" \
    "$(json_str "$1.log")" >>"$out/checks.jsonl"
  printf '   %-24s %-8s %4ss  %s\n' "$1" "$2" "${4:-0}" "$5"
}

# --- stages and checks ----------------------------------------------------------------------------------------------
stage="" stage_end=0
begin_stage() {  # NAME BUDGET_S
  stage="$1"
  local end=$((SECONDS + $2))
  stage_end=$((end < run_end ? end : run_end))
  printf '{"stage": "%s", "budget_s": %s, "started_s": %s}\n' "$1" "$2" $((SECONDS - run_start)) >>"$out/stages.jsonl"
  echo "== $1 (budget $2 s, $((run_end - SECONDS)) s left in all)"
}

# check NAME CAP_S CMD...: runs CMD under timeout (its cap, or what is left of the stage) with output in NAME.log.
# The status is pass (exit 0), timeout, or fail; a verifier `verify_NAME LOG` (if defined) may then print a reason
# to fail a command that exited 0.
check() {
  local name="$1" cap="$2"
  shift 2
  local left=$((stage_end - SECONDS))
  ((cap < left)) && left=$cap
  if ((left <= 0)); then
    record "$name" skipped null 0 "no time left in the $stage stage"
    return 0
  fi
  local t0=$SECONDS rc status=pass reason=""
  timeout -k 5 "$left" $line_buffered "$@" >"$out/$name.log" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then
    status=timeout reason="killed after $left s"
  elif ((rc != 0)); then
    status=fail reason="$(tail -n 1 "$out/$name.log" | cut -c1-300)"
  elif declare -F "verify_$name" >/dev/null; then
    reason="$("verify_$name" "$out/$name.log")"
    [[ -n "$reason" ]] && status=fail
  fi
  record "$name" "$status" "$rc" $((SECONDS - t0)) "$reason"
}

skip() { record "$1" skipped null 0 "$2"; }

# measured NAME CAP_S CMD...: check, with the GPU's used memory sampled every 200 ms into NAME.gpu_mem (MiB, one
# line per sample): the device-level peak (CUDA context, cuBLAS workspace and the allocator's cached blocks included)
# beside the engine's own accounting. Without nvidia-smi, a plain check.
measured() {
  local sampler=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$out/$1.gpu_mem" 2>/dev/null &
    sampler=$!
  fi
  check "$@"
  [[ -n "$sampler" ]] && kill "$sampler" 2>/dev/null
  return 0
}

# A gtest binary that ran no test (a filter matching nothing), or skipped for want of a GPU, passed without testing
# anything: a failure.
gtest_ran() {  # LOG
  local n
  n="$(grep -m1 -o -E '^\[==========\] [0-9]+ tests? from [0-9]+ test suites? ran' "$1" | awk '{print $2}')"
  if [[ -z "$n" || "$n" == 0 ]]; then
    echo "no test ran"
  elif ((!tiny)); then
    grep -m1 "no usable CUDA device" "$1" | cut -c1-300
  fi
}
verify_ops_test() { gtest_ran "$1"; }
verify_cuda_strategy_test() { gtest_ran "$1"; }
verify_bf16_strategy_test() { gtest_ran "$1"; }
verify_memcheck() { gtest_ran "$1"; }
verify_racecheck() { gtest_ran "$1"; }

# gradcheck's JSON (last line of its log): the strategy's gradients against full's within the bound.
gradcheck_bound() {
  "$python" - "$1" "$2" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
if not lines:
    print("no result line")
    sys.exit()
r, bound = json.loads(lines[-1]), float(sys.argv[2])
if not r["max_rel_err"] <= bound:
    print(f"max_rel_err {r['max_rel_err']:.3e} > {bound:g} ({r['worst_param']})")
PY
}
verify_gradcheck_seco() { gradcheck_bound "$1" 1e-10; }
verify_gradcheck_streambp() { gradcheck_bound "$1" 1e-10; }

# --- libraries ------------------------------------------------------------------------------------------------------
# CUDA's libraries come from the machine: the toolkit, else PyTorch's NVIDIA wheels (NCCL is not in the toolkit).
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
missing_libraries() { ldd "$bin"/* 2>/dev/null | awk '/not found/ {print $1}' | sort -u; }
if [[ -n "$(missing_libraries)" && -n "$python" ]]; then
  wheels="$("$python" -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null || true)"
  for lib in $([[ -n "$wheels" ]] && missing_libraries); do
    found="$(find $wheels -name "$lib" 2>/dev/null | head -1)"
    [[ -n "$found" ]] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$found")"
  done
fi
verify_libraries() {
  local m
  m="$(missing_libraries | tr '\n' ' ')"
  [[ -n "$m" ]] && echo "not found: $m(LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
}

# --- the stages -----------------------------------------------------------------------------------------------------
if ((tiny)); then
  # The emulated device: tiny shapes; test subsets that cover every kind of check in seconds.
  export SG_EMU_DEVICE_MEMORY="${SG_EMU_DEVICE_MEMORY:-536870912}"
  ops_filter="CudaOpsTest/f32.RmsNormForwardBackward:GpuTest.Bf16ConversionsMatchCpuBitForBit"
  strategy_filter="CudaStrategyTest.TransformerF32StrategiesMatchFull"
  bf16_filter="CudaBf16StrategyTest.TrainingStepsMastersAndRoundsWeights"
  llama=tiny qwen=tiny speed_lens=(64 128) memory_lens=(64 128) chunk=32 page=16 lora=4
  hybrid_len=64 hybrid_chunk=24  # the emulated Gated DeltaNet and router kernels are slow
else
  ops_filter="*" strategy_filter="*" bf16_filter="*"
  llama=llama-1b-shape qwen=qwen2.5-7b-shape speed_lens=(8192 32768) memory_lens=(16384 32768) chunk=4096 page=256
  lora=16 hybrid_len=256 hybrid_chunk=48
fi

begin_stage correctness 80
if ((tiny)); then
  skip nvidia_smi "--tiny: the emulated device"
elif command -v nvidia-smi >/dev/null; then
  check nvidia_smi 20 nvidia-smi
else
  record nvidia_smi fail null 0 "nvidia-smi not found: no GPU driver on this machine"
fi
check libraries 10 bash -c 'cat "$0/manifest.json"; ldd --version | head -1; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
                              ldd "$0"/bin/*' "$here"
check ops_test 60 "$bin/ops_test" --gtest_filter="$ops_filter" --gtest_output="json:$out/ops_test.gtest.json"
check cuda_strategy_test 90 "$bin/cuda_strategy_test" --gtest_filter="$strategy_filter" \
  --gtest_output="json:$out/cuda_strategy_test.gtest.json"
check bf16_strategy_test 45 "$bin/bf16_strategy_test" --gtest_filter="$bf16_filter" \
  --gtest_output="json:$out/bf16_strategy_test.gtest.json"
for s in seco streambp; do
  check "gradcheck_$s" 30 "$bin/gradcheck" --device=cuda --model=tiny --dtype=f64 --strategy=$s --chunk=48 \
    --page_size=16 --seq_len=256 --json="$out/gradcheck_$s.json"
done
# The Qwen3.5 hybrid (Gated DeltaNet's kernels, gated attention) and a Qwen3-Next with experts (the router's
# kernels, experts grouped by expert) on the GPU, against full backprop there.
check gradcheck_qwen3.5_seco 30 "$bin/gradcheck" --device=cuda --model=tiny-qwen3.5 --dtype=f64 --strategy=seco \
  --chunk=$hybrid_chunk --page_size=16 --seq_len=$hybrid_len --json="$out/gradcheck_qwen3.5_seco.json"
check gradcheck_qwen3_next_seco 30 "$bin/gradcheck" --device=cuda --model=tiny-qwen3-next --dtype=f64 \
  --strategy=seco --chunk=$hybrid_chunk --page_size=16 --seq_len=$hybrid_len \
  --json="$out/gradcheck_qwen3_next_seco.json"

# bench --compare_torch needs a python3 with torch (CUDA) and transformers.
torch_ok="$("$python" -c 'import torch, transformers; print(int(torch.cuda.is_available()))' 2>/dev/null || true)"
bench_common=(--device=cuda --dtype=bf16 --matmul=bf16 --repeats=1 --warmup=1 --chunk=$chunk --page_size=$page)
begin_stage speed 150
for T in "${speed_lens[@]}"; do
  torch_flags=()
  [[ "$torch_ok" == 1 ]] && torch_flags=(--compare_torch --torch_strategies=full,ckpt --python="$python"
                                         --torch_script="$here/scripts/bench_torch_gpu.py")
  measured "bench_speed_$T" $((T > 8192 ? 110 : 60)) "$bin/bench" "${bench_common[@]}" --model=$llama \
    --strategies=full,seco --seq_lens=$T \
    "${torch_flags[@]}" --json="$out/bench_speed_$T.json"
done
[[ "$torch_ok" == 1 ]] || skip torch_reference "no python3 with CUDA torch and transformers: seqgrad rows only"
if ((tiny)) && [[ "$torch_ok" != 1 && -n "$python" ]]; then
  # Without PyTorch the script still reads the command line bench gives it (a flag it did not know cost the speed
  # stage of a GPU run): it must get past its arguments.
  check torch_arguments 30 bash -c '"$@" 2>&1 | tee /dev/stderr | grep -q "bench_torch_gpu.py: arguments read"' \
    torch_arguments "$bin/bench" "${bench_common[@]}" --model=$llama --strategies=full --seq_lens=${speed_lens[0]} \
    --compare_torch --torch_strategies=full,ckpt --python="$python" --torch_script="$here/scripts/bench_torch_gpu.py"
fi

begin_stage memory 130
for T in "${memory_lens[@]}"; do
  # The plan of a training step at T on the meta device (its optimizer state included), then one step measured: a
  # process per length, so that each GPU peak is that length's.
  check "plan_$T" 10 "$bin/plan" --model=$qwen --dtype=bf16 --strategy=seco --offload --chunk=$chunk \
    --page_size=$page --lora_rank=$lora --seq_len=$T --json
  measured "bench_offload_$T" 60 "$bin/bench" "${bench_common[@]}" --warmup=0 --model=$qwen \
    --strategies=seco:offload --lora_rank=$lora --seq_lens=$T --json="$out/bench_offload_$T.json"
done

begin_stage extras 70
gpu_tool() {  # NAME: its path, or nothing (always nothing under --tiny: the emulated device has no such tools)
  ((tiny)) || command -v "$1" || ls "/usr/local/cuda/bin/$1" 2>/dev/null || true
}
sanitizer="$(gpu_tool compute-sanitizer)"
if [[ -n "$sanitizer" ]]; then
  check memcheck 25 "$sanitizer" --tool memcheck --error-exitcode 1 "$bin/ops_test" \
    --gtest_filter="CudaOpsTest/f32.*:Paged/CudaAttentionTest.*"
  # The loss, five times over: shared-memory races, then reads of memory never written.
  check racecheck 15 bash -c '"$0" --tool racecheck --error-exitcode 1 "$1" --gtest_filter="*CrossEntropy*" \
                                --gtest_repeat=5 && "$0" --tool initcheck --error-exitcode 1 "$1" \
                                --gtest_filter="*CrossEntropy*"' "$sanitizer" "$bin/ops_test"
else
  skip memcheck "compute-sanitizer not found"
  skip racecheck "compute-sanitizer not found"
fi
ncu="$(gpu_tool ncu)"
if [[ -n "$ncu" ]]; then
  # Kernel times of one seco step (two chunks), its first 200 launches: enough to rank the kernels.
  check kernel_profile 45 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-count 200 \
    --log-file "$out/kernel_profile.csv" "$bin/bench" "${bench_common[@]}" --warmup=0 --model=$llama \
    --strategies=seco --seq_lens=$((chunk * 2))
else
  skip kernel_profile "ncu not found"
fi

# --- summary --------------------------------------------------------------------------------------------------------
elapsed=$((SECONDS - run_start))
if [[ -n "$python" ]]; then
  "$python" "$here/scripts/gpu_check_summary.py" "$out" "$budget_s" "$elapsed" "$tiny" || echo "summary failed"
else
  echo "no python3: checks.jsonl has the results, summary.json is not written"
fi
echo "== done in $elapsed s: $out"
if [[ -n "${OUT:-}" && "$(cd "$OUT" 2>/dev/null && pwd)" != "$out" ]]; then
  cp -f "$out/summary.json" "$out/checks.jsonl" "$OUT/" 2>/dev/null
  tar czf "$OUT/gpu_results.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed into $OUT"
fi
! grep -q -E '"status": "(fail|timeout)"' "$out/checks.jsonl"
