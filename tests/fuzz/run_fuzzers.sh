#!/bin/bash
# Builds the libFuzzer targets (clang, ASan + UBSan: --config=fuzz) and runs each for a bounded time from a copy of
# its checked-in seed corpus. A crash, leak, sanitizer report or timeout fails the run and leaves the input that
# caused it in $work/<target>/. The seed is fixed, so a run explores the same inputs first every time.
# usage: tests/fuzz/run_fuzzers.sh [SECONDS_PER_TARGET]   (from the repository root; default 30)
set -euo pipefail
seconds="${1:-30}"
targets=(config safetensors index jsonl)
./bazelw build --config=fuzz $(printf '//tests:%s_fuzzer ' "${targets[@]}")
bin="$(./bazelw info --config=fuzz bazel-bin 2>/dev/null)/tests"
work="$(mktemp -d)"
for t in "${targets[@]}"; do
  mkdir -p "$work/$t/corpus"
  cp -r "tests/fuzz/corpus/$t/." "$work/$t/corpus/"
  echo "fuzzing $t for ${seconds}s"
  (cd "$work/$t" && "$bin/${t}_fuzzer" -max_total_time="$seconds" -seed=1 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 corpus >"$work/$t/log" 2>&1) || { tail -40 "$work/$t/log"; echo "FAIL: $t"; exit 1; }
  grep -E "stat::number_of_executed_units" "$work/$t/log" | sed "s/^/  $t: /"
done
rm -rf "$work"
echo "run_fuzzers.sh: ${#targets[@]} targets, ${seconds}s each, no crash"
