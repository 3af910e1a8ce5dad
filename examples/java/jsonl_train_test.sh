#!/bin/bash
# Runs the JSONL pipeline for 2 epochs and checks that it printed losses and that the loss went down; then with LoRA,
# a cosine schedule, gradient accumulation and checkpoints: a run stopped after step 1 and resumed prints the losses
# of an uninterrupted run, and the final adapter is written.
# usage: jsonl_train_test.sh JAVA EXAMPLE_JAR SEQGRAD_JAR JSONL NATIVE_LIB
set -euo pipefail
java="$1"; example="$2"; seqgrad="$3"; data="$4"; native_dir="$(dirname "$(readlink -f "$5")")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
# Native libraries from the override directory (-Dseqgrad.library.path), not from the jar.
run() {
  "$java" -Dseqgrad.library.path="$native_dir" -cp "$example:$seqgrad" org.seqgrad.examples.JsonlTrain "$@"
}
out="$(run "$data" 2 4)"
echo "$out"
test "$(grep -c '^epoch .* loss ' <<<"$out")" -eq 4
first="$(grep '^epoch' <<<"$out" | head -1 | awk '{print $6}')"
last="$(grep '^epoch' <<<"$out" | tail -1 | awk '{print $6}')"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "loss did not go down: $first -> $last"; exit 1; }

lora=(--dtype=f64 --lora-rank=4 --lora-dropout=0.1 --lora-targets=q_proj,k_proj,v_proj,o_proj --lr=2e-2
      --lr-schedule=cosine --warmup-steps=1 --grad-accum=2 --save-every=1 --keep=2)
full="$(run "$data" 2 2 tiny seco "${lora[@]}" --out-dir="$tmp/a")"
echo "$full"
grep -q '^LoRA r=4 ' <<<"$full"
test "$(grep -c '^epoch .* loss ' <<<"$full")" -eq 4  # 8 records: 4 micro-batches of 2 per epoch, 2 per step
test -f "$tmp/a/adapter/adapter_model.safetensors" && test -f "$tmp/a/adapter/adapter_config.json"
test "$(ls -d "$tmp"/a/checkpoint-* | wc -l)" -eq 2  # --keep=2
part1="$(run "$data" 2 2 tiny seco "${lora[@]}" --out-dir="$tmp/b" --stop-at-step=1)"
part2="$(run "$data" 2 2 tiny seco "${lora[@]}" --out-dir="$tmp/b" --resume)"
echo "$part2"
grep -q '^resumed from step 1 (record 4)$' <<<"$part2"
losses() { grep '^epoch' | awk '{print $2, $4, $6, $8}'; }
diff <(losses <<<"$full") <(cat <(losses <<<"$part1") <(losses <<<"$part2")) || {
  echo "resumed losses differ from the uninterrupted run"; exit 1; }
echo "OK: resumed run matches"
