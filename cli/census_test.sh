#!/usr/bin/env bash
# bench --census: the roofline census of llama-1b-shape in bf16, counted on meta (no GPU, --device=cuda in any
# build): families add up to the total, attention matches the causal formula, model FLOPs the parameter count,
# the MFU bound is a fraction; bad flags are named.
# usage: census_test.sh <bench binary>
set -euo pipefail
bench="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
"$bench" --census --device=cuda --model=llama-1b-shape --dtype=bf16 --strategies=seco,streambp \
  --seq_lens=8192,16384 --chunk=4096 --page_size=256 --json="$tmp/c.json" >"$tmp/out.txt"
grep -q "a model, not a measurement" "$tmp/out.txt"
grep -q "MFU upper bound" "$tmp/out.txt"
/usr/bin/python3 - "$tmp/c.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = doc["rows"]
assert [(r["strategy"], r["seq_len"]) for r in rows] == [("seco", 8192), ("seco", 16384), ("streambp", 8192),
                                                         ("streambp", 16384)], rows
# llama-1b-shape: d 2048, 16 layers, 32 heads of 64, 8 KV heads, ffn 8192, vocabulary 32000
L, d, H, G, hd, f, V = 16, 2048, 32, 8, 64, 8192, 32000
matmul = L * (2 * d * H * hd + 2 * d * G * hd + 3 * d * f) + V * d
for r in rows:
    T = r["seq_len"]
    pairs = T * (T + 1) // 2
    fam, total = r["families"], r["total"]
    for k in ("calls", "flops", "bytes"):
        assert sum(f[k] for f in fam.values()) == total[k], (k, r)
    assert abs(sum(f["roofline_ms"] for f in fam.values()) - total["roofline_ms"]) < 1e-6 * total["roofline_ms"]
    assert r["model_flops"] == 6 * matmul * T + 12 * hd * H * L * pairs, r
    # backward: a dQ pass (3 products) and a dK/dV pass (4) over every causal pair of every layer
    assert fam["attention_bwd"]["flops"] == 7 * 2 * hd * H * L * pairs, r
    assert fam["attention_bwd"]["bound"] == "compute" and fam["pointwise"]["bound"] == "memory", r
    assert fam["bf16_round"]["flops"] == 0 and fam["bf16_round"]["bytes"] > 0, r
    peak, bw = doc["limits"]["peak_flops"], doc["limits"]["bandwidth_bytes_per_s"]
    # every op's time is at least its FLOPs at peak and its bytes at bandwidth
    assert total["roofline_ms"] >= 1e3 * max(total["flops"] / peak, total["bytes"] / bw) * (1 - 1e-9), r
    mfu = r["model_flops"] / (peak * total["roofline_ms"] / 1e3)
    assert abs(mfu - r["mfu_upper_bound"]) < 1e-9 and 0 < mfu < 1, r
print("ok")
PY

# Bad input: the flag is named, exit 1.
expect_error() {  # expect_error <text> <args...>
  local want="$1"; shift
  if "$bench" --census "$@" >"$tmp/bad.txt" 2>&1; then echo "expected failure: $*"; exit 1; fi
  grep -q -- "$want" "$tmp/bad.txt" || { echo "no '$want' in:"; cat "$tmp/bad.txt"; exit 1; }
}
# spaco and sparse pages do less than the model's work by design: no MFU bound, the census still counts.
for flags in "--strategies=seco --sparse_pages=2" "--strategies=spaco --spaco_budget=2"; do
  # shellcheck disable=SC2086
  "$bench" --census --model=tiny --seq_lens=256 --chunk=32 --page_size=8 $flags --json="$tmp/s.json" |
    grep -q "no MFU bound"
  /usr/bin/python3 -c '
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
assert len(rows) == 1 and rows[0]["mfu_upper_bound"] is None and rows[0]["total"]["flops"] > 0, rows' "$tmp/s.json"
done

expect_error "--seq_lens" --model=tiny --strategies=seco --seq_lens=8k
expect_error "--strategies" --model=tiny --strategies=seco:offload --seq_lens=64
expect_error "neither a preset" --model=no-such-model --strategies=seco --seq_lens=64
expect_error "strategy" --model=tiny --strategies=nope --seq_lens=64
echo PASS
