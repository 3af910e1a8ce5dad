#!/usr/bin/env bash
# LoRA through the tools, as a user runs them: gradcheck --lora_* on both families (only adapters checked, exact),
# train --lora_rank writing a PEFT adapter and the report's "lora" object with grads/optimizer memory of the
# adapters only, --lora_init continuing from it, --merge_lora writing a plain HF model that loads back, and the
# errors for bad LoRA flags and adapters.
# usage: lora_tools_test.sh <gradcheck> <train>
set -euo pipefail
gradcheck="$1"; train="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }

for m in tiny tiny-ssm; do
  for s in seco streambp; do
    "$gradcheck" --model=$m --strategy=$s --dtype=f64 --chunk=7 --lora_rank=3 --lora_targets=all --lora_dropout=0.2 \
      --json="$tmp/$m-$s.json" >/dev/null 2>"$tmp/gc.err"
    grep -q "LoRA r=3 alpha=6 dropout=0.2" "$tmp/gc.err" || fail "gradcheck did not enable LoRA: $(cat "$tmp/gc.err")"
  done
done

common=(--model=tiny --seq_len=600 --steps=3 --lr=1e-2 --strategy=seco --chunk=128)
"$train" "${common[@]}" --report="$tmp/full.json" >/dev/null 2>&1
"$train" "${common[@]}" --lora_rank=4 --lora_targets=q_proj,v_proj,down_proj --lora_dropout=0.1 \
  --report="$tmp/lora.json" --save="$tmp/adapter" >/dev/null 2>"$tmp/train.err"
grep -q "LoRA r=4 alpha=8 dropout=0.1 on q_proj,v_proj,down_proj (9 modules)" "$tmp/train.err" \
  || fail "train: $(cat "$tmp/train.err")"
[ -f "$tmp/adapter/adapter_config.json" ] && [ -f "$tmp/adapter/adapter_model.safetensors" ] || fail "no adapter files"
[ ! -f "$tmp/adapter/model.safetensors" ] || fail "--save with LoRA wrote a full model"
"$train" "${common[@]}" --lora_init="$tmp/adapter" --save="$tmp/merged" --merge_lora --report="$tmp/init.json" \
  >/dev/null 2>"$tmp/init.err"
grep -q "from $tmp/adapter" "$tmp/init.err" || fail "--lora_init: $(cat "$tmp/init.err")"
[ -f "$tmp/merged/model.safetensors" ] && [ -f "$tmp/merged/config.json" ] || fail "--merge_lora wrote no model"
"$gradcheck" --model="$tmp/merged" --strategy=seco --dtype=f64 --chunk=7 --json="$tmp/merged.json" >/dev/null 2>&1 \
  || fail "the merged model does not load"

/usr/bin/python3 - "$tmp" <<'PY'
import json, struct, sys
tmp = sys.argv[1]
load = lambda n: json.load(open(f"{tmp}/{n}.json"))
for m in ("tiny", "tiny-ssm"):
    for s in ("seco", "streambp"):
        r = load(f"{m}-{s}")
        assert r["max_rel_err"] <= 1e-10, r
        assert r["params_checked"] == 2 * r["lora"]["adapters"], r
full, lora, init = load("full"), load("lora"), load("init")
assert full["lora"] is None, full
assert lora["lora"]["rank"] == 4 and lora["lora"]["targets"] == ["q_proj", "v_proj", "down_proj"], lora["lora"]
adapter_bytes = 4 * lora["lora"]["trainable_params"]  # f32
g, o = lora["peak_bytes_by_category"]["grads"], lora["peak_bytes_by_category"]["optimizer"]
assert g == adapter_bytes, (g, adapter_bytes)
assert o == 2 * adapter_bytes, (o, adapter_bytes)
assert full["peak_bytes_by_category"]["grads"] > 10 * g, (full["peak_bytes_by_category"], g)
assert init["lora"]["rank"] == 4 and init["lora"]["dropout"] == 0.1, init["lora"]
cfg = json.load(open(f"{tmp}/adapter/adapter_config.json"))
assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["base_model_name_or_path"] == "tiny", cfg
raw = open(f"{tmp}/merged/model.safetensors", "rb").read()
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
assert not [k for k in header if "lora" in k], sorted(header)
print(f"LoRA OK: grads {g} B, optimizer {o} B (full fine-tuning: grads {full['peak_bytes_by_category']['grads']} B)")
PY

expect_error() {  # expect_error <message> <args...>
  local msg="$1"; shift
  if "$train" "$@" >"$tmp/out" 2>&1; then fail "expected an error for: $*"; fi
  grep -qF -- "$msg" "$tmp/out" || fail "expected '$msg' for: $*; got: $(cat "$tmp/out")"
}
expect_error "--lora_rank must be positive" --model=tiny --seq_len=600 --steps=1 --lora_rank=-2
expect_error "--lora_targets: 'x_proj' is not a linear module or expert weight of a transformer model" --model=tiny --seq_len=600 \
  --steps=1 --lora_rank=2 --lora_targets=x_proj
expect_error "--lora_targets: no module of this model is named in_proj" --model=tiny --seq_len=600 --steps=1 --lora_rank=2 \
  --lora_targets=in_proj
expect_error "--lora_targets: 'out_proj' is not supported on mamba2: PEFT refuses" --model=tiny-mamba2 --seq_len=600 \
  --steps=1 --lora_rank=2 --lora_targets=in_proj,out_proj
expect_error "--lora_dropout must be in [0, 1)" --model=tiny --seq_len=600 --steps=1 --lora_rank=2 --lora_dropout=1
expect_error "need --lora_rank" --model=tiny --seq_len=600 --steps=1 --lora_targets=q_proj
expect_error "--merge_lora needs LoRA" --model=tiny --seq_len=600 --steps=1 --merge_lora
expect_error "--lora_rank=8 vs r 4" --model=tiny --seq_len=600 --steps=1 --lora_init="$tmp/adapter" --lora_rank=8
expect_error "$tmp/nothing/adapter_config.json" --model=tiny --seq_len=600 --steps=1 --lora_init="$tmp/nothing"
expect_error "but this model needs" --model=tiny-qwen2 --seq_len=600 --steps=1 --lora_init="$tmp/adapter"
head -c 100 "$tmp/adapter/adapter_model.safetensors" > "$tmp/trunc.safetensors"
mkdir -p "$tmp/trunc" && cp "$tmp/adapter/adapter_config.json" "$tmp/trunc/" \
  && mv "$tmp/trunc.safetensors" "$tmp/trunc/adapter_model.safetensors"
expect_error "$tmp/trunc/adapter_model.safetensors" --model=tiny --seq_len=600 --steps=1 --lora_init="$tmp/trunc"
# --offload_experts: a mixture of experts' frozen experts made in host memory and streamed; the same losses.
moe=(--model=tiny-qwen3-moe --seq_len=600 --steps=2 --lr=1e-2 --strategy=seco --chunk=128 --lora_rank=2
     --lora_targets=q_proj,experts.gate_up_proj,experts.down_proj)
"$train" "${moe[@]}" --report="$tmp/moe.json" >/dev/null 2>&1 || fail "train on tiny-qwen3-moe"
"$train" "${moe[@]}" --offload_experts --report="$tmp/moe_offload.json" >/dev/null 2>&1 || fail "--offload_experts"
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("moe", "moe_offload"))
assert a["losses"] == b["losses"], (a["losses"], b["losses"])  # (its memory: core/expert_offload_test)
print(f"--offload_experts OK: the same losses {b['losses']}")
PY
expect_error "--offload_experts keeps the expert weights in host memory and needs them frozen" --model=tiny-qwen3-moe \
  --seq_len=600 --steps=1 --offload_experts
expect_error "--offload_experts: this llama model has no mixture-of-experts layers" --model=tiny --seq_len=600 \
  --steps=1 --lora_rank=2 --offload_experts
echo "lora_tools_test: OK"
