#!/usr/bin/env bash
# train's --save and --out_dir: everything a save needs (target, the source model's side files) is checked before the
# first step; the saved model carries no file from outside the source directory; a save that fails after training
# keeps the trained model elsewhere; staging directories of killed saves are removed by the next run. Also JSONL
# records longer than --seq_len: refused unless --overlong=truncate or split, and counted.
# usage: train_save_test.sh <train>
set -euo pipefail
train="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export TMPDIR="$tmp/tmpdir"
mkdir -p "$TMPDIR"
fail() { echo "FAIL: $*" >&2; exit 1; }
run=(--model=tiny --seq_len=600 --steps=1)  # the synthetic task needs >= 528 tokens

# expect_refused NAME PATTERN ARGS...: exit 1 with PATTERN in the error, and no step trained.
expect_refused() {
  local name="$1" pattern="$2"; shift 2
  local rc=0
  "$train" "${run[@]}" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  [ "$rc" -eq 1 ] || { cat "$tmp/$name.err"; fail "$name: exit $rc, want 1"; }
  grep -qF -- "$pattern" "$tmp/$name.err" || { cat "$tmp/$name.err"; fail "$name: no '$pattern' in the error"; }
  ! grep -q "^done:" "$tmp/$name.out" || fail "$name: refused only after training"
  echo "$name: $(tail -1 "$tmp/$name.err")"
}

# Targets that cannot be saved to.
echo x >"$tmp/a_file"
expect_refused dev_null "error: --save: /dev/null: exists and is not a directory" --save=/dev/null
expect_refused file "error: --save: $tmp/a_file: exists and is not a directory" --save="$tmp/a_file"
expect_refused no_parent "error: --save: $tmp/missing: cannot save there" --save="$tmp/missing/model"

# A source model directory whose side files cannot be carried over into the saved model.
src="$tmp/src"
"$train" "${run[@]}" --save="$src" >/dev/null 2>&1 || fail "saving the source model"
echo '{"password": "hunter2"}' >"$tmp/secret.json"
side() {  # side COMMAND...: the source's side files are what COMMAND makes
  rm -rf "$src/tokenizer.json" "$src/generation_config.json"
  "$@"
}
put() { printf '%s\n' "$2" >"$1"; }
side mkfifo "$src/tokenizer.json"
expect_refused fifo "cannot carry over $src/tokenizer.json: is a FIFO" --model="$src" --save="$tmp/m"
expect_refused fifo_out_dir "error: --out_dir: cannot carry over $src/tokenizer.json: is a FIFO" --model="$src" \
  --out_dir="$tmp/run"
side mkdir "$src/tokenizer.json"
expect_refused directory "cannot carry over $src/tokenizer.json: is a directory" --model="$src" --save="$tmp/m"
side ln -s nowhere "$src/tokenizer.json"
expect_refused dangling "cannot carry over $src/tokenizer.json: a link that leads nowhere" --model="$src" --save="$tmp/m"
side ln -s tokenizer.json "$src/tokenizer.json"
expect_refused looping "a link that leads nowhere (Too many levels of symbolic links)" --model="$src" --save="$tmp/m"
side ln -s /dev/zero "$src/tokenizer.json"
expect_refused dev_zero "it links to /dev/zero, outside the model directory" --model="$src" --save="$tmp/m"
side truncate -s 1100M "$src/tokenizer.json"
expect_refused huge "tokenizer.json: is 1153433600 bytes, more than the limit of 1073741824" --model="$src" --save="$tmp/m"
side ln -s "$tmp/secret.json" "$src/generation_config.json"
expect_refused secret "cannot carry over $src/generation_config.json: it links to $tmp/secret.json, outside the model" \
  --model="$src" --save="$tmp/m"
side put "$src/generation_config.json" '{"eos_token_id": '
expect_refused bad_json "cannot carry over $src/generation_config.json: not valid JSON" --model="$src" --save="$tmp/m"
[ ! -e "$tmp/m" ] && [ ! -e "$tmp/run/model.safetensors" ] || fail "a refused save wrote something"
side put "$src/tokenizer.json" '{"model": {"type": "BPE"}}'
"$train" "${run[@]}" --model="$src" --save="$tmp/m" >/dev/null 2>&1 || fail "saving with a good tokenizer.json"
cmp "$src/tokenizer.json" "$tmp/m/tokenizer.json" || fail "tokenizer.json was not carried over"

# The target's parent disappears during the run (removed here by --keep_checkpoints=1, as soon as checkpoint-4 is
# written): the save fails after the last step, and the trained model is kept elsewhere, as the final --out_dir model.
"$train" "${run[@]}" --steps=4 --stop_at_step=2 --out_dir="$tmp/o" >/dev/null 2>&1 || fail "checkpoint-2"
rc=0
"$train" "${run[@]}" --steps=4 --out_dir="$tmp/o" --resume --keep_checkpoints=1 --save="$tmp/o/checkpoint-2/model" \
  >"$tmp/kept.out" 2>"$tmp/kept.err" || rc=$?
[ "$rc" -eq 1 ] || { cat "$tmp/kept.err"; fail "failed final save: exit $rc, want 1"; }
kept=$(sed -n 's/^error: --save: .*the trained model is kept in \([^ ]*\) instead.*/\1/p' "$tmp/kept.err")
[ -n "$kept" ] || { cat "$tmp/kept.err"; fail "no 'kept in' in the error"; }
[ "$(dirname "$kept")" = "$TMPDIR" ] || fail "kept in $kept, not under \$TMPDIR"
cmp "$kept/model.safetensors" "$tmp/o/model.safetensors" || fail "the kept weights differ from the trained ones"
echo "failed final save: $(grep "^error" "$tmp/kept.err")"

# Staging directories beside the target: a killed save's (unlocked) goes at the next start, even of a run refused
# for something else, or at the next save; a live save's (locked) stays.
stale="$tmp/s/m.seqgrad-save-AbC123" live="$tmp/s/m.seqgrad-save-LiVe99"
mkdir -p "$stale" "$live"
head -c 1048576 /dev/zero >"$stale/model.safetensors"
flock "$live" sleep 60 &
holder=$!
side mkfifo "$src/tokenizer.json"
expect_refused stale_at_start "is a FIFO" --model="$src" --save="$tmp/s/m"
[ ! -e "$stale" ] || fail "a killed save's staging directory was left at the start"
mkdir -p "$stale"
"$train" "${run[@]}" --save="$tmp/s/m" >/dev/null 2>&1 || fail "saving beside staging directories"
[ ! -e "$stale" ] || fail "a killed save's staging directory was left by the next save"
[ -d "$live" ] || fail "a live save's staging directory was removed"
kill "$holder"
echo "staging directories: $(ls "$tmp/s")"

# JSONL records longer than --seq_len + 1 tokens.
/usr/bin/python3 - "$tmp/long.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"input_ids": [1 + i % 90 for i in range(100)]}) + "\n")
    f.write(json.dumps({"input_ids": [1 + i % 90 for i in range(700)]}) + "\n")
PY
expect_refused overlong "error: --data: $tmp/long.jsonl:2: field 'input_ids' has 700 tokens (699 positions to train), more than --seq_len=600; 1 of 2 records" \
  --data="$tmp/long.jsonl"
"$train" "${run[@]}" --data="$tmp/long.jsonl" --overlong=split >"$tmp/split.out" 2>&1 || fail "--overlong=split"
grep -qF "long.jsonl (2 records -> 3 sequences; 1 split)" "$tmp/split.out" || { cat "$tmp/split.out"; fail "split counts"; }
"$train" "${run[@]}" --data="$tmp/long.jsonl" --overlong=truncate >"$tmp/trunc.out" 2>&1 || fail "--overlong=truncate"
grep -qF "long.jsonl (2 records; 1 truncated (99 tokens cut))" "$tmp/trunc.out" || { cat "$tmp/trunc.out"; fail "truncate counts"; }
echo "train save test OK"
