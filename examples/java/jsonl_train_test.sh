#!/bin/bash
# Runs the JSONL pipeline for 2 epochs and checks that it printed losses and that the loss went down; that labels in
# the file (Hugging Face's convention) are trained as given and bad ones are refused naming the line; then with LoRA,
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
losses() { grep '^epoch' | awk '{print $2, $4, $6, $8, $10}'; }  # epoch, step, loss, lr, tokens
out="$(run "$data" 2 4 tiny seco --out-dir="$tmp/base")"  # also writes a Hugging Face model: $tmp/base/model
echo "$out"
test "$(grep -c '^epoch .* loss ' <<<"$out")" -eq 4
test "$(grep -c ' tokens 124 ' <<<"$out")" -eq 4  # next-token labels: 31 of each record's 32 tokens, 4 records
first="$(grep '^epoch' <<<"$out" | head -1 | awk '{print $6}')"
last="$(grep '^epoch' <<<"$out" | tail -1 | awk '{print $6}')"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "loss did not go down: $first -> $last"; exit 1; }

# Hugging Face labels from the file go to the trainer as they are: labels = input_ids trains exactly as without labels
# (a binding or example shifting them once more would train the next-but-one token), and a masked prompt leaves
# only its completion's tokens labelled.
sed 's/{"input_ids": \(\[[^]]*\]\)}/{"input_ids": \1, "labels": \1}/' "$data" >"$tmp/same.jsonl"
test "$(grep -c '"labels"' "$tmp/same.jsonl")" -eq 8
diff <(losses <<<"$out") <(run "$tmp/same.jsonl" 2 4 | losses) || { echo "labels = input_ids changed training"; exit 1; }
awk -F'[][]' '{ n = split($2, a, ", "); s = ""
                for (i = 1; i <= n; ++i) s = s (i > 1 ? ", " : "") (i <= 16 ? -100 : a[i])
                print "{\"input_ids\": [" $2 "], \"labels\": [" s "]}" }' "$data" >"$tmp/masked.jsonl"
masked="$(run "$tmp/masked.jsonl" 1 4)"
echo "$masked"
test "$(grep -c ' tokens 64 ' <<<"$masked")" -eq 2  # positions 16..31 of 4 records per step
# The pipeline on a Hugging Face model directory: LoRA with seco on records cut to --seq-len + 1 = 24 tokens (so
# positions 16..23 stay labelled), the adapter naming its base. Its first step has the base's loss (LoRA starts as
# the identity): the trained model's is below the fresh preset's.
e2e() { run "$tmp/masked.jsonl" 1 4 "$1" seco --lora-rank=4 --seq-len=23 --chunk=8 --out-dir="$2"; }
hf_run="$(e2e "$tmp/base/model" "$tmp/e2e")"
echo "$hf_run"
grep -q "^seqgrad .*, model $tmp/base/model, strategy seco$" <<<"$hf_run"
grep -q '^8 of 8 records longer than --seq-len + 1 = 24 tokens: cut to that$' <<<"$hf_run"
test "$(grep -c ' tokens 32 ' <<<"$hf_run")" -eq 2
test -f "$tmp/e2e/adapter/adapter_model.safetensors"
grep -qF "\"base_model_name_or_path\": \"$tmp/base/model\"" "$tmp/e2e/adapter/adapter_config.json"
trained="$(grep '^epoch' <<<"$hf_run" | head -1 | awk '{print $6}')"
fresh="$(e2e tiny "$tmp/e2e_fresh" | grep '^epoch' | head -1 | awk '{print $6}')"
awk -v a="$trained" -v b="$fresh" 'BEGIN { exit !(a < b) }' || { echo "the model directory was not used: $trained vs $fresh"; exit 1; }
# Bad labels name the file and line.
bad() {
  { head -2 "$data"; echo "$1"; } >"$tmp/bad.jsonl"
  if err="$(run "$tmp/bad.jsonl" 1 4 2>&1)"; then echo "accepted: $1"; exit 1; fi
  grep -qF "error: $tmp/bad.jsonl:3: $2" <<<"$err" || { echo "unexpected error for $1: $err"; exit 1; }
}
bad '{"input_ids": [1, 2, 3], "labels": [2, 3]}' "'labels' has 2 entries but 'input_ids' has 3"
bad '{"input_ids": [1, 2, 3], "labels": [-100, -5, 3]}' "'labels' holds -5; need -100 or a token id"
bad '{"input_ids": [1, 2, 3], "labels": [1, x, 3]}' "field 'labels' holds 'x', not an integer"

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
diff <(losses <<<"$full") <(cat <(losses <<<"$part1") <(losses <<<"$part2")) || {
  echo "resumed losses differ from the uninterrupted run"; exit 1; }
echo "OK: resumed run matches"
