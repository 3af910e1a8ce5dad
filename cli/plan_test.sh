#!/usr/bin/env bash
# cli:plan: a preset, a bare config.json and an HF directory plan the same; --json carries every category;
# the memory check before training agrees with the plan (train refuses a --seq_len the plan says does not fit in
# a smaller host, via --memory_budget); --memory's answer fits and one more token does not; 7B at 128K is quick;
# dense --offload keeps the 7B's device memory flat from 100K to 110K tokens (bf16 LoRA, the issue's yardstick); bad input is refused by name (an overflowing --seq_len, --memory, --lora_init, --device, the model).
# usage: plan_test.sh <plan> <train>
set -uo pipefail
plan="$1" train="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # expect_error <pattern> <plan args...>
  local pattern="$1"; shift
  if "$plan" "$@" >"$tmp/out" 2>&1; then cat "$tmp/out"; fail "accepted: $*"; fi
  grep -qF -- "$pattern" "$tmp/out" || { cat "$tmp/out"; fail "no '$pattern' for: $*"; }
}
field() { /usr/bin/python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

# The same architecture three ways: preset, config.json (no weights), and a directory holding it.
cat >"$tmp/config.json" <<'JSON'
{"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
 "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": false}
JSON
mkdir -p "$tmp/qwen" && cp "$tmp/config.json" "$tmp/qwen/"
args=(--strategy=seco --chunk=4096 --lora_rank=16 --seq_len=131072 --json)
start=$(date +%s)
"$plan" --model=qwen2.5-7b "${args[@]}" >"$tmp/preset.json" || fail "preset"
end=$(date +%s)
(( end - start <= 20 )) || fail "7B at 128K took $((end - start)) s"
"$plan" --model="$tmp/config.json" "${args[@]}" >"$tmp/file.json" || fail "config.json"
"$plan" --model="$tmp/qwen" "${args[@]}" >"$tmp/dir.json" || fail "directory"
for f in file dir; do
  [[ "$(field "$tmp/$f.json" 'j["device_peak"]')" == "$(field "$tmp/preset.json" 'j["device_peak"]')" ]] ||
    fail "$f plans differently from the preset"
done
# 28 layers x 131072 tokens x (K and V: 2 x 512) x 4 bytes
[[ "$(field "$tmp/preset.json" 'j["device_peak"]["kv_cache"]')" == $((28 * 131072 * 2 * 512 * 4)) ]] || fail "kv_cache"
[[ "$(field "$tmp/preset.json" 'j["lora"]["rank"]')" == 16 ]] || fail "lora"

# --memory: the answer fits, one token more does not.
"$plan" --model=demo --strategy=seco --chunk=256 --memory=64M --json >"$tmp/fit.json" || fail "--memory"
T=$(field "$tmp/fit.json" 'j["seq_len"]')
(( $(field "$tmp/fit.json" 'j["device_total_peak"]') <= 64 * 1048576 )) || fail "the answer does not fit"
"$plan" --model=demo --strategy=seco --chunk=256 --seq_len=$((T + 1)) --json >"$tmp/next.json" || fail "T+1"
(( $(field "$tmp/next.json" 'j["device_total_peak"]') > 64 * 1048576 )) || fail "T+1 = $((T + 1)) fits too"
# Offload reports host bytes; the text table names every category.
"$plan" --model=tiny --strategy=seco --chunk=64 --page_size=16 --offload --sparse_pages=2 --seq_len=1024 \
  >"$tmp/offload.txt" || fail "offload"
for w in weights grads optimizer activations kv_cache kv_grad logits workspace master_weights total "host (offloaded"; do
  grep -q "^$w" "$tmp/offload.txt" || { cat "$tmp/offload.txt"; fail "no $w"; }
done
# Dense offload streams attention's pages through a ring: Qwen2.5-7B's device peak does not grow from 100K to 110K
# tokens (the target: <= 20 MB per 10K), and the host holds 28 layers x T (whole pages of 256) x (K, V and their
# gradients: 4 x 512) x 2 bytes.
for T in 100000 110000; do
  "$plan" --model=qwen2.5-7b-shape --dtype=bf16 --lora_rank=16 --strategy=seco --chunk=1024 --offload --seq_len=$T \
    --json >"$tmp/dense$T.json" || fail "dense offload at $T"
  [[ "$(field "$tmp/dense$T.json" 'j["host_bytes"]')" == $((28 * ((T + 255) / 256 * 256) * 4 * 512 * 2)) ]] ||
    { cat "$tmp/dense$T.json"; fail "dense offload host bytes at $T"; }
done
growth=$(( $(field "$tmp/dense110000.json" 'j["device_total_peak"]') - $(field "$tmp/dense100000.json" 'j["device_total_peak"]') ))
(( growth <= 20000000 )) || fail "dense offload grows by $growth bytes per 10K tokens"
"$plan" --model=tiny-ssm --strategy=adjoint --chunk=64 --seq_len=4096 --objective=grpo >/dev/null || fail "ssm grpo"
# bf16 Mamba plans its fp32 masters in master_weights: 4 bytes per element of its bf16 matrices (tiny-ssm: 3
# layers of in_proj 2E x d, x_proj (R + 2N) x E, dt_proj E x R, out_proj d x E with d 16, E 32, N 4, R 2; the
# embedding 97 x d, tied head).
"$plan" --model=tiny-ssm --dtype=bf16 --strategy=seco --chunk=64 --seq_len=256 --json >"$tmp/ssm16.json" ||
  fail "ssm bf16"
masters=$((4 * (97 * 16 + 3 * (64 * 16 + 10 * 32 + 32 * 2 + 16 * 32))))
[[ "$(field "$tmp/ssm16.json" 'j["device_peak"]["master_weights"]')" == "$masters" ]] ||
  { cat "$tmp/ssm16.json"; fail "bf16 Mamba's masters"; }

# --memory_budget in train picks by the plan: the chunk it prints fits the budget.
"$train" --model=demo --seq_len=2048 --strategy=seco --memory_budget=6000000 --steps=1 2>"$tmp/train.err" >/dev/null ||
  { cat "$tmp/train.err"; fail "train --memory_budget"; }
grep -q "memory budget 5.7 MiB: --chunk=" "$tmp/train.err" || { cat "$tmp/train.err"; fail "no budget line"; }

expect_error "--seq_len=4611686018427387904: the plan's byte counts overflow 64 bits" --model=qwen2.5-32b \
  --strategy=seco --seq_len=4611686018427387904
expect_error "--memory: 'lots' is not a positive byte count" --model=tiny --memory=lots
expect_error "--memory: '-5G' is not a positive byte count" --model=tiny --memory=-5G
expect_error "--lora_init: plan reads no weights" --model=tiny --lora_init="$tmp"
expect_error "--device: plan always runs on --device=meta" --model=tiny --device=cuda
expect_error "--model: 'nope' is neither a preset" --model=nope
expect_error "--seq_len must be positive" --model=tiny --seq_len=0
expect_error "even 1 tokens do not fit" --model=tiny --memory=1K
echo PASS
