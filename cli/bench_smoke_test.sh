#!/usr/bin/env bash
# Smoke test of //cli:bench: tiny model, both engines, JSON + SVG written. Never asserts on timing.
# usage: bench_smoke_test.sh <bench binary>
set -euo pipefail
bench="$1"
out="${TEST_TMPDIR:-$(mktemp -d)}/b.json"
"$bench" --model=tiny --strategies=full,ckpt --seq_lens=64,128 --repeats=1 --warmup=1 --compare_torch \
  --memory_budget=1500000 --json="$out"
/usr/bin/python3 - "$out" <<'PY'
import json, math, sys
import xml.etree.ElementTree as ET

path = sys.argv[1]
with open(path) as f:
    d = json.load(f)
rows = d["rows"]
want = {(e, s, t) for e in ("seqgrad", "torch") for s in ("full", "ckpt") for t in (64, 128)}
have = {(r["engine"], r["strategy"], r["seq_len"]) for r in rows}
assert want <= have, f"missing rows: {sorted(want - have)}"
assert d["sgemm_gflops"] > 0
for r in rows:
    assert r["time_s"] > 0 and r["tokens_per_s"] > 0, r
    assert math.isfinite(r["loss"]), r
    assert r["gflops"] > 0 and "gflops_per_s" in r and "sgemm_fraction" in r, r
    if r["engine"] == "seqgrad":
        for k in ("peak_bytes", "activation_peak_bytes", "activation_peak_bytes_upper", "kv_bytes"):
            assert isinstance(r[k], int) and r[k] > 0, (k, r)
        assert r["activation_peak_bytes"] <= r["activation_peak_bytes_upper"] <= r["peak_bytes"] * 3, r
        assert sum(r["peak_bytes_by_category"].values()) >= r["peak_bytes"], r
        assert r["step_peak_bytes"] == r["peak_bytes"] - r["resting_bytes"], r
    else:
        assert r["peak_bytes"] is None, r
        assert r["step_peak_bytes"] is None or r["step_peak_bytes"] > 0, r
# Same weights and tokens: the two engines' losses agree.
loss = {(r["engine"], r["strategy"], r["seq_len"]): r["loss"] for r in rows}
for (e, s, t) in want:
    if e == "seqgrad":
        a, b = loss[(e, s, t)], loss[("torch", s, t)]
        assert abs(a - b) <= 1e-3 * abs(b), (s, t, a, b)
# Every PyTorch engine is labelled with its versions; transformers' engine (hf) either ran or says why not.
torch_info = d["torch"]
assert torch_info["labels"]["torch"].startswith("torch " + torch_info["torch_version"]), torch_info
if "hf" in torch_info["labels"]:
    assert any(r["engine"] == "hf" for r in rows), rows
else:
    assert "transformers" in torch_info["skipped_engines"]["hf"], torch_info
n_engines = len(torch_info["labels"])
assert len(d["ratios"]) == 4 * n_engines, d["ratios"]
assert {r["versus"] for r in d["ratios"]} == set(torch_info["labels"]), d["ratios"]
assert d["config"]["model"] == "tiny"
budget = {b["strategy"]: b for b in d["budget"]}
assert set(budget) == {"full", "ckpt"}, budget
for b in budget.values():
    assert b["budget_bytes"] == 1500000 and 0 <= b["max_seq_len_in_budget"] <= 65536, b
    fits = [p["seq_len"] for p in b["probes"] if p.get("peak_bytes", 1 << 62) <= 1500000]
    assert b["max_seq_len_in_budget"] == max(fits, default=0), b

svg = path[:-5] + ".svg"
root = ET.parse(svg).getroot()
assert root.tag.endswith("svg"), root.tag
texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
for word in ("peak memory vs T", "time vs T", "seqgrad full", "torch ckpt"):
    assert word in texts, (word, texts)
print("bench smoke test OK:", len(rows), "rows")
PY

# bf16 storage against PyTorch's bf16 autocast: both losses close to each other (bf16 rounding apart).
out3="${TEST_TMPDIR:-$(mktemp -d)}/bf16.json"
"$bench" --model=tiny --dtype=bf16 --strategies=full --seq_lens=64 --repeats=1 --warmup=0 --compare_torch \
  --json="$out3"
/usr/bin/python3 - "$out3" <<'PY'
import json, sys

d = json.load(open(sys.argv[1]))
assert d["config"]["dtype"] == "bf16" and d["torch"]["dtype"] == "bf16 autocast", (d["config"], d["torch"])
loss = {r["engine"]: r["loss"] for r in d["rows"]}
assert abs(loss["seqgrad"] - loss["torch"]) <= 2e-2 * abs(loss["torch"]), loss
print("bf16 bench OK")
PY

# The chunked strategies, the forward-only baseline and the checks the bench derives from them.
out2="${TEST_TMPDIR:-$(mktemp -d)}/chunked.json"
"$bench" --model=tiny --strategies=full,seco,spaco,streambp,forward --seq_lens=64,256 --chunk=16 --page_size=8 \
  --repeats=2 --warmup=0 --json="$out2"
/usr/bin/python3 - "$out2" <<'PY'
import json, math, sys

d = json.load(open(sys.argv[1]))
rows = {(r["strategy"], r["seq_len"]): r for r in d["rows"]}
assert set(rows) == {(s, t) for s in ("full", "seco", "spaco", "streambp", "forward") for t in (64, 256)}, rows.keys()
for t in (64, 256):
    # Same tokens: every strategy (and the forward-only pass) reports the same loss.
    for s in ("seco", "spaco", "streambp", "forward"):
        assert abs(rows[(s, t)]["loss"] - rows[("full", t)]["loss"]) < 1e-4, (s, t)
    sp = rows[("spaco", t)]
    assert sp["time_stat"] == "mean" and sp["gflops"] is None, sp
    assert sp["spaco_budget"] == max(1, round(t / 16 / 8)), sp
    assert 0 <= sp["chunks_backpropagated"] <= sp["chunks"] == t / 16, sp
    assert rows[("seco", t)]["chunks_backpropagated"] == rows[("seco", t)]["chunks"] == t / 16
    assert rows[("forward", t)]["chunks_backpropagated"] == 0
checks = d["checks"]
assert [r["seq_len"] for r in checks["time_ratios"]] == [64, 256], checks
for r in checks["time_ratios"]:
    for k in ("seco_over_full", "spaco_over_forward", "spaco_over_seco", "forward_over_full"):
        assert r[k] > 0, (k, r)
m = checks["seco_memory"]
# seco: activations do not grow with T; the total grows by exactly the KV cache + KV gradient per token.
assert m["activation_change"] == 0, m
assert m["kv_cache_growth_bytes_per_token"] == m["kv_grad_growth_bytes_per_token"] == m["state_bytes_per_token"], m
assert m["peak_growth_bytes_per_token"] == 2 * m["state_bytes_per_token"], m
print("chunked bench OK")
PY

# --lora_rank: the adapters train, the base is frozen (its gradients are never allocated), as in train.
out4="${TEST_TMPDIR:-$(mktemp -d)}/lora.json"
"$bench" --model=tiny --strategies=seco --seq_lens=64 --repeats=1 --warmup=0 --lora_rank=4 --json="$out4"
/usr/bin/python3 - "$out" "$out4" <<'PY'
import json, sys

full, lora = (json.load(open(p)) for p in sys.argv[1:])
assert full["config"]["lora"] is None, full["config"]
assert lora["config"]["lora"]["rank"] == 4, lora["config"]
resting = {d["config"]["lora"] is None: d["rows"][0]["peak_bytes_by_category"]["grads"] for d in (full, lora)}
assert resting[False] < resting[True], resting
print("lora bench OK")
PY

# A PyTorch side that fails (here: an interpreter that exits 1) costs its rows only: seqgrad's are written, the error
# is named in the JSON, and the exit status is 1. --torch_strategies picks PyTorch's strategies apart from seqgrad's.
out5="${TEST_TMPDIR:-$(mktemp -d)}/torch_fails.json"
if "$bench" --model=tiny --strategies=seco --torch_strategies=full --seq_lens=64 --repeats=1 --warmup=0 \
    --compare_torch --python=/bin/false --json="$out5" 2>"$out5.err"; then
  echo "bench exited 0 although its PyTorch side failed" >&2; exit 1
fi
grep -q "bench_torch.py failed" "$out5.err" || { cat "$out5.err" >&2; exit 1; }
/usr/bin/python3 - "$out5" <<'PY'
import json, sys

d = json.load(open(sys.argv[1]))
assert [r["engine"] for r in d["rows"]] == ["seqgrad"], d["rows"]
assert "bench_torch.py failed" in d["torch_error"], d.get("torch_error")
print("torch failure OK")
PY
if "$bench" --model=tiny --strategies=seco --torch_strategies=fast --seq_lens=64 --compare_torch 2>"$out5.err"; then
  exit 1
fi
grep -q -- "--torch_strategies: 'fast'" "$out5.err" || { cat "$out5.err" >&2; exit 1; }

# Qwen3 (tiny varied by --config_overrides) in f64: the plain-ops engine applies Qwen3's per-head q/k norms, so its
# loss equals seqgrad's; seco is compared with PyTorch's full (the same gradient), forward with nothing.
out6="${TEST_TMPDIR:-$(mktemp -d)}/qwen3.json"
"$bench" --model=tiny --config_overrides='{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}' \
  --dtype=f64 --strategies=full,seco,forward --chunk=32 --seq_lens=64 --repeats=1 --warmup=0 --compare_torch \
  --json="$out6"
/usr/bin/python3 - "$out6" <<'PY'
import json, sys

d = json.load(open(sys.argv[1]))
assert d["config"]["architecture"] == "qwen3" and d["config"]["model"] == "tiny", d["config"]
ratios = {(r["strategy"], r["versus"]): r for r in d["ratios"]}
assert set(ratios) == {("full", "torch"), ("seco", "torch")}, ratios.keys()
assert ratios[("seco", "torch")]["torch_strategy"] == "full", ratios
for r in ratios.values():
    assert r["loss_rel_diff"] < 1e-10, r
print("qwen3 bench OK")
PY

# One layer of a model the plain-ops engine cannot run (a preset varied by --config_overrides): that engine is skipped,
# saying why, and the run goes on (transformers, their reference, is not in /usr/bin/python3). A Gated DeltaNet
# layer, and a Mamba-2 layer (the engine read its config as a Llama's and failed).
out7="${TEST_TMPDIR:-$(mktemp -d)}/hybrid.json"
skips_plain_ops() {  # skips_plain_ops <preset> <config overrides> <in the description> <in the skip's reason>
  "$bench" --model="$1" --config_overrides="$2" --strategies=full --seq_lens=64 --repeats=1 --warmup=0 \
    --compare_torch --json="$out7"
  /usr/bin/python3 - "$out7" "$3" "$4" <<'PY'
import json, sys

d = json.load(open(sys.argv[1]))
c = d["config"]
assert c["num_layers"] == 1 and c["vocab_size"] == 16 and sys.argv[2] in c["description"], c
assert sys.argv[3] in d["torch"]["skipped_engines"]["torch"], d["torch"]
assert "torch" not in d["torch"]["labels"] and all(r["engine"] != "torch" for r in d["rows"]), d["rows"]
print(c["architecture"], "bench without the plain-ops engine OK")
PY
}
skips_plain_ops tiny-qwen3.5 '{"num_hidden_layers": 1, "layer_types": ["linear_attention"], "vocab_size": 16}' \
  "1 Gated DeltaNet" "Gated DeltaNet"
skips_plain_ops tiny-mamba2 '{"num_hidden_layers": 1, "vocab_size": 16}' "1 Mamba-2" "no Mamba-2 mixer (mamba2)"

# Bad --config_overrides: named before any work.
expect_error() {  # expect_error <message> <bench flags...>
  local want="$1"; shift
  if "$bench" --strategies=full --seq_lens=64 "$@" 2>"$out7.err"; then echo "accepted: $*" >&2; exit 1; fi
  grep -qF -- "$want" "$out7.err" || { echo "want '$want' for $*:" >&2; cat "$out7.err" >&2; exit 1; }
}
expect_error "--config_overrides: must be a JSON object, got '[1]'" --model=tiny --config_overrides='[1]'
expect_error "--config_overrides: tiny's config.json merged with them: field 'num_hidden_layers' must be positive" \
  --model=tiny --config_overrides='{"num_hidden_layers": 0}'
expect_error "--config_overrides: varies a preset (random weights); --model=$out7.err is not one" \
  --model="$out7.err" --config_overrides='{}'
expect_error "--census: counts a preset or a model directory as it is: drop --config_overrides" --census \
  --model=tiny --config_overrides='{}'
echo "config_overrides errors OK"
