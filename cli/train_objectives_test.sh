#!/usr/bin/env bash
# //cli:train with --objective=sft|dpo|grpo on the tiny preset: each run exits 0 and reports finite losses;
# dpo without reference log-probs in the data works with --ref_model and fails clearly without; malformed lines
# fail with a message naming the file, the line and the field; the shipped data files are what make_tiny.py writes.
# usage: train_objectives_test.sh <train binary> <dpo_tiny.jsonl> <grpo_tiny.jsonl> <make_tiny.py>
set -euo pipefail
train="$1"; dpo="$2"; grpo="$3"; make_tiny="$4"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

fail() { echo "FAIL: $*" >&2; exit 1; }

# The shipped files are up to date with their generator (which is deterministic).
mkdir -p "$tmp/regen"
/usr/bin/python3 "$make_tiny" --out "$tmp/regen"
cmp "$tmp/regen/dpo_tiny.jsonl" "$dpo" || fail "dpo_tiny.jsonl differs from what make_tiny.py writes"
cmp "$tmp/regen/grpo_tiny.jsonl" "$grpo" || fail "grpo_tiny.jsonl differs from what make_tiny.py writes"

# run NAME OBJECTIVE [FLAGS...]: trains 3 steps and checks the report.
run() {
  local name="$1" objective="$2"; shift 2
  local report="$tmp/$name.json"
  local rc=0
  "$train" --model=tiny --objective="$objective" --steps=3 --report="$report" "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || { cat "$tmp/$name.out"; fail "$name: train exited with $rc"; }
  /usr/bin/python3 - "$report" "$objective" "$name" <<'PY'
import json, math, sys
path, objective, name = sys.argv[1:]
with open(path) as f:
    r = json.load(f)
assert r["objective"] == objective, (name, r["objective"])
assert r["model"] == "tiny" and r["steps"] == 3 and len(r["losses"]) == 3, (name, r)
for k in ("loss_first", "loss_last"):
    assert math.isfinite(r[k]), (name, k, r[k])
assert all(math.isfinite(x) for x in r["losses"]), (name, r["losses"])
assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0, (name, r)
print(f"{name}: {objective} loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
PY
}

run dpo_streambp dpo --data="$dpo" --strategy=streambp --chunk=8
run dpo_seco_batch dpo --data="$dpo" --strategy=seco --chunk=8 --batch=4
run grpo_streambp grpo --data="$grpo" --strategy=streambp --chunk=8
run grpo_seco grpo --data="$grpo" --strategy=seco --chunk=8 --batch=2
run sft_streambp sft --seq_len=544 --strategy=streambp --chunk=64
grep -q "objective=dpo" "$tmp/dpo_streambp.out" || fail "the objective is not printed"

# dpo without ref_* fields: the reference model supplies them; without one, a clear error.
sed 's/, "ref_chosen_logp": [^}]*//' "$dpo" >"$tmp/dpo_noref.jsonl"
! grep -q ref_ "$tmp/dpo_noref.jsonl" || fail "could not strip the ref_* fields"
run dpo_ref_model dpo --data="$tmp/dpo_noref.jsonl" --ref_model=tiny --strategy=streambp --chunk=8

# expect_error NAME PATTERN [FLAGS...]: train fails (exit 1) and its stderr holds PATTERN (fixed string).
expect_error() {
  local name="$1" pattern="$2"; shift 2
  local rc=0
  "$train" --model=tiny --steps=1 "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || { cat "$tmp/$name.out"; fail "$name: exit $rc, want 1"; }
  grep -qF -- "$pattern" "$tmp/$name.out" || { cat "$tmp/$name.out"; fail "$name: no '$pattern' in the output"; }
  echo "$name: $(tail -1 "$tmp/$name.out")"
}

expect_error dpo_no_ref "6 of 6 pairs in $tmp/dpo_noref.jsonl have no ref_chosen_logp / ref_rejected_logp: give --ref_model" \
  --objective=dpo --data="$tmp/dpo_noref.jsonl"
expect_error dpo_no_data "--objective=dpo needs --data" --objective=dpo
expect_error grpo_no_data "--objective=grpo needs --data" --objective=grpo

# A malformed line 3 in a copy of each file.
awk 'NR == 3 { print "{\"prompt\": [1, 2], \"chosen\": [3,"; next } { print }' "$dpo" >"$tmp/dpo_bad.jsonl"
expect_error dpo_malformed "error: --data: $tmp/dpo_bad.jsonl:3: malformed JSON at column" \
  --objective=dpo --data="$tmp/dpo_bad.jsonl" --strategy=streambp --chunk=8
awk 'NR == 2 { sub(/"advantages": \[[^]]*\]/, "\"advantages\": [1, -1]") } { print }' "$grpo" >"$tmp/grpo_bad.jsonl"
expect_error grpo_advantages "error: --data: $tmp/grpo_bad.jsonl:2: field 'advantages' has 2 entries for G = 4 completions" \
  --objective=grpo --data="$tmp/grpo_bad.jsonl" --strategy=streambp --chunk=8
awk 'NR == 4 { sub(/"prompt": \[/, "\"prompt\": [97, ") } { print }' "$dpo" >"$tmp/dpo_vocab.jsonl"
expect_error dpo_vocab "$tmp/dpo_vocab.jsonl:4: field 'prompt[0]' is 97, outside the vocabulary [0, 97)" \
  --objective=dpo --data="$tmp/dpo_vocab.jsonl"
echo "train objectives test OK"
