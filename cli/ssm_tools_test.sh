#!/usr/bin/env bash
# The tools on the Mamba preset, as a user runs them: gradcheck of every exact strategy (adjoint's three forms and
# its truncation sweep), bench rows for the adjoint variants, training with adjoint, and the errors for bad
# adjoint flags.
# usage: ssm_tools_test.sh <gradcheck> <bench> <train>
set -euo pipefail
gradcheck="$1"; bench="$2"; train="$3"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }

# Exact strategies against full backprop in f64 (K = 3 layers, ragged batch, chunks of 7).
for s in seco streambp adjoint; do
  "$gradcheck" --model=tiny-ssm --strategy="$s" --dtype=f64 --chunk=7 --json="$tmp/$s.json" >/dev/null
done
"$gradcheck" --model=tiny-ssm --strategy=adjoint --adjoint_form=scan --dtype=f64 --chunk=7 --json="$tmp/scan.json" >/dev/null
"$gradcheck" --model=tiny-ssm --strategy=adjoint --adjoint_form=paper --dtype=f64 --chunk=7 --json="$tmp/paper.json" >/dev/null
"$gradcheck" --model=tiny-ssm --strategy=adjoint --dtype=f64 --chunk=16 --seq_len=64 \
  --adjoint_windows=1,4,16,64,none --json="$tmp/sweep.json" >/dev/null
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
load = lambda n: json.load(open(f"{tmp}/{n}.json"))
for n in ("seco", "streambp", "adjoint", "scan"):
    r = load(n)
    assert r["max_rel_err"] <= 1e-10, (n, r)
assert load("paper")["max_rel_err"] > 1e-6, load("paper")  # the paper's multi-layer formula is not exact
sweep = load("sweep")
assert [r["adjoint_window"] for r in sweep] == [1, 4, 16, 64, None], sweep
# The batch is 64 + 21 tokens; pairs per layer and channel: sum over sequences of wT - w(w-1)/2, w = min(window, T).
def pairs(w):
    return sum(min(w, T) * T - min(w, T) * (min(w, T) - 1) // 2 for T in (64, 21))
for r in sweep:
    w = r["adjoint_window"] or 1 << 30
    assert r["adjoint_pairs_per_layer"] == pairs(w), (r, pairs(w))
errs = [r["max_rel_err"] for r in sweep]
assert errs[-1] <= 1e-10 and errs[-2] <= 1e-10, errs  # window >= T is exact
assert errs[0] > errs[2] > 1e-8, errs                   # truncation errs, less with a longer window
print("gradcheck OK; truncation sweep:", [(r["adjoint_window"], r["adjoint_pairs_per_layer"], r["max_rel_err"]) for r in sweep])
PY

# Bench rows for the adjoint variants.
"$bench" --model=tiny-ssm --strategies=seco,adjoint,adjoint:8,adjoint:scan --seq_lens=64,128 --chunk=32 \
  --repeats=1 --warmup=0 --json="$tmp/bench.json" >/dev/null 2>&1 || fail "bench"
/usr/bin/python3 - "$tmp/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = {(r["strategy"], r["seq_len"]): r for r in d["rows"]}
for T in (64, 128):
    assert rows[("adjoint", T)]["adjoint_pairs_per_layer"] == T * (T + 1) // 2, rows[("adjoint", T)]
    assert rows[("adjoint:8", T)]["adjoint_pairs_per_layer"] == 8 * T - 28, rows[("adjoint:8", T)]
    assert rows[("adjoint:scan", T)]["adjoint_pairs_per_layer"] == 0
    for s in ("seco", "adjoint", "adjoint:8", "adjoint:scan"):
        assert abs(rows[(s, T)]["loss"] - rows[("seco", T)]["loss"]) < 1e-6, (s, T)
for s in ("seco", "adjoint", "adjoint:8", "adjoint:scan"):
    assert s in d["checks"]["memory_growth"] and s in d["checks"]["time_exponents"], s
print("bench OK")
PY

# Training with adjoint lowers the loss.
"$train" --model=tiny-ssm --strategy=adjoint --adjoint_window=64 --seq_len=600 --chunk=128 --steps=30 --lr=0.01 \
  --report="$tmp/train.json" >/dev/null 2>&1 || fail "train with adjoint"
/usr/bin/python3 - "$tmp/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
losses = r["losses"]
assert losses[-1] < losses[0] - 0.5, losses
print("train OK:", losses[0], "->", losses[-1])
PY

# Bad flags: clear errors naming the flag.
expect_error() {  # expect_error TEXT CMD...
  local text="$1"; shift
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  [ "$rc" -ne 0 ] || fail "expected failure: $*"
  grep -qF -- "$text" <<<"$out" || fail "expected '$text' in: $out"
}
expect_error "--adjoint_window must be a positive number" "$gradcheck" --model=tiny-ssm --strategy=adjoint --adjoint_window=0
expect_error "--adjoint_window must be a positive number" "$train" --model=tiny-ssm --strategy=adjoint --adjoint_window=-5 --steps=1
expect_error "needs a state-space model" "$train" --model=tiny --strategy=adjoint --steps=1 --seq_len=600
expect_error "--adjoint_form: unknown form 'fast'" "$gradcheck" --model=tiny-ssm --strategy=adjoint --adjoint_form=fast
echo "ssm tools test OK"
