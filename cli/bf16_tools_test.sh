#!/usr/bin/env bash
# --dtype=bf16 through the tools, as a user runs them: Mamba and Llama train in bf16 and save bf16 by default or f32
# with --save_dtype=f32; a bf16 run's checkpoint resumes in bf16 and is refused in f32; flags that cannot apply are
# refused before anything runs, naming the flag (gradcheck compares in f64/f32; --save_dtype=bf16 of an f32 model).
# usage: bf16_tools_test.sh <train> <gradcheck>
set -euo pipefail
train="$1"; gradcheck="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }
saved_dtypes() {  # saved_dtypes DIR: config.json's torch_dtype, then the set of dtypes in model.safetensors
  /usr/bin/python3 - "$1" <<'PY'
import json, struct, sys
d = sys.argv[1]
with open(f"{d}/model.safetensors", "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
print(json.load(open(f"{d}/config.json"))["torch_dtype"],
      ",".join(sorted({v["dtype"] for k, v in header.items() if k != "__metadata__"})))
PY
}

for model in tiny-ssm tiny; do
  "$train" --model="$model" --dtype=bf16 --seq_len=600 --chunk=128 --strategy=seco --steps=20 --lr=0.01 \
    --report="$tmp/$model.json" --save="$tmp/$model-bf16" >"$tmp/$model.out" 2>&1 ||
    { cat "$tmp/$model.out"; fail "train $model"; }
  grep -q "master_weights" "$tmp/$model.out" ||
    { cat "$tmp/$model.out"; fail "$model: no master_weights in the summary"; }
  /usr/bin/python3 - "$tmp/$model.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
assert r["peak_bytes_by_category"]["master_weights"] > 0, r["peak_bytes_by_category"]
PY
  [ "$(saved_dtypes "$tmp/$model-bf16")" = "bfloat16 BF16,F32" ] ||
    fail "$model: bf16 save: $(saved_dtypes "$tmp/$model-bf16")"
  "$train" --model="$model" --dtype=bf16 --seq_len=600 --steps=1 --save="$tmp/$model-f32" --save_dtype=f32 \
    >/dev/null 2>&1 || fail "$model: --save_dtype=f32"
  [ "$(saved_dtypes "$tmp/$model-f32")" = "float32 F32" ] || fail "$model: f32 save: $(saved_dtypes "$tmp/$model-f32")"
  # The saved model trains on in bf16 (loaded as it was saved).
  "$train" --model="$tmp/$model-bf16" --dtype=bf16 --seq_len=600 --steps=1 >/dev/null 2>&1 || fail "$model: reload"
done

expect_error() {  # expect_error TEXT CMD...
  local text="$1"; shift
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  [ "$rc" -ne 0 ] || fail "expected failure: $*"
  grep -qF -- "$text" <<<"$out" || fail "expected '$text' in: $out"
}
# A bf16 run's checkpoint: resumed in bf16, refused in f32 (the fp32 masters and bf16 weights are no f32 state).
"$train" --model=tiny --dtype=bf16 --seq_len=600 --steps=2 --out_dir="$tmp/run" >/dev/null 2>&1 || fail "bf16 run"
"$train" --model=tiny --dtype=bf16 --seq_len=600 --steps=3 --out_dir="$tmp/run" --resume >/dev/null 2>&1 ||
  fail "bf16 resume"
expect_error "--dtype" "$train" --model=tiny --dtype=f32 --seq_len=600 --steps=4 --out_dir="$tmp/run" --resume
expect_error "--dtype=bf16: gradcheck compares gradients in f64 or f32" "$gradcheck" --model=tiny-ssm --dtype=bf16
expect_error "--save_dtype is bf16 but the model stores its weights in f32" "$train" --model=tiny --steps=1 \
  --save="$tmp/never" --save_dtype=bf16
[ ! -e "$tmp/never" ] || fail "--save_dtype=bf16 of an f32 model wrote something"
expect_error "--save_dtype: 'f16' is not a save dtype" "$train" --model=tiny --dtype=bf16 --steps=1 --save_dtype=f16
expect_error "--save_dtype: LoRA saves the adapters" "$train" --model=tiny --dtype=bf16 --steps=1 --lora_rank=2 \
  --save_dtype=f32
echo "bf16 tools test OK"
