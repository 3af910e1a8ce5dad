#!/usr/bin/env bash
# //cli:train's evaluation and reports on the tiny presets: --report with --eval_every writes the summary
# fields, per-step metrics and evaluations, and three SVG plots that parse as XML with the expected titles; off a
# terminal no progress line is printed (only the summary), on one (through script(1)) the line is rewritten in
# place; the Mamba preset evaluates too; --eval_data reads held-out token files; bad combinations fail clearly.
# usage: report_train_test.sh <train binary> <dpo_tiny.jsonl>
set -euo pipefail
train="$1"; dpo="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

fail() { echo "FAIL: $*" >&2; exit 1; }

# 5 steps of tiny on the synthetic task (600 tokens: 16 keys and 128 queries fit), evaluating every 2 steps.
common=(--seq_len=600 --chunk=128 --steps=5 --eval_every=2 --eval_sequences=2)
rc=0
"$train" --model=tiny --strategy=seco "${common[@]}" --report="$tmp/run.json" >"$tmp/out.txt" 2>"$tmp/err.txt" || rc=$?
[ "$rc" -eq 0 ] || { cat "$tmp/out.txt" "$tmp/err.txt"; fail "train exited with $rc"; }

# Not a terminal: no progress lines (neither the in-place line nor periodic ones), only the summary.
if grep -q "step [0-9]*/5" "$tmp/out.txt" "$tmp/err.txt"; then cat "$tmp/out.txt" "$tmp/err.txt"; fail "progress lines off a terminal"; fi
if grep -q $'\r' "$tmp/out.txt" "$tmp/err.txt"; then fail "carriage returns off a terminal"; fi
grep -q "^done: 5 steps" "$tmp/out.txt" || { cat "$tmp/out.txt"; fail "no summary"; }
grep -q "^eval (held-out, step 5): loss" "$tmp/out.txt" || { cat "$tmp/out.txt"; fail "no evaluation in the summary"; }
grep -q "accuracy by key-query distance:" "$tmp/out.txt" || { cat "$tmp/out.txt"; fail "no accuracy by distance"; }

/usr/bin/python3 - "$tmp" <<'PY'
import json, math, os, sys
import xml.etree.ElementTree as ET
tmp = sys.argv[1]
r = json.load(open(os.path.join(tmp, "run.json")))
summary = ["model", "objective", "strategy", "seq_len", "chunk", "steps", "loss_first", "loss_last", "tokens_per_s",
           "peak_bytes", "peak_bytes_by_category", "losses"]
keys = list(r)
assert all(k in keys for k in summary), keys  # the summary's fields, in their order, before what reports add
assert [k for k in keys if k in summary] == summary, keys
assert keys.index("losses") < keys.index("metrics"), keys
assert r["model"] == "tiny" and r["strategy"] == "seco" and r["steps"] == 5 and len(r["losses"]) == 5, r
m = r["metrics"]
assert [x["step"] for x in m] == [1, 2, 3, 4, 5], m
for x in m:
    for k in ("loss", "lr", "grad_norm", "tokens_per_s", "seconds"):
        assert isinstance(x[k], float) and math.isfinite(x[k]), (k, x)
    assert x["loss"] == r["losses"][x["step"] - 1] or abs(x["loss"] - r["losses"][x["step"] - 1]) < 1e-6
    assert x["tokens"] == 600 and x["peak_bytes"] > 0, x
    cats = x["peak_bytes_by_category"]
    assert set(cats) == set(r["peak_bytes_by_category"]), cats
    assert cats["weights"] > 0 and cats["activations"] > 0 and x["peak_bytes"] <= r["peak_bytes"], x
    assert ("eval" in x) == (x["step"] in (2, 4, 5)), x
ev = [x["eval"] for x in m if "eval" in x]
assert [e["step"] for e in r["evals"]] == [2, 4, 5], r["evals"]
for e in r["evals"]:
    assert e["sequences"] == 2 and e["tokens"] == 256, e
    assert abs(e["perplexity"] - math.exp(e["loss"])) < 1e-9 * e["perplexity"], e
    assert 0 <= e["accuracy"] <= 1
    b = e["accuracy_by_distance"]
    assert b and sum(x["count"] for x in b) == e["tokens"], b
    assert sum(x["correct"] for x in b) == round(e["accuracy"] * e["tokens"]), b
    for x in b:
        lo, hi = x["distance_min"], x["distance_max"]
        assert lo >= 1 and hi == 2 * lo - 1 and lo & (lo - 1) == 0, x
t = r["memory_timeline"]
assert t["step"] == 5 and t["events"] > 10 and len(t["event_index"]) > 10, t
assert max(a + b for a, b in zip(t["bytes_by_category"]["activations"], t["bytes_by_category"]["weights"])) > 0
assert r["plots"] == ["run.loss.svg", "run.accuracy.svg", "run.memory.svg"], r["plots"]
titles = {"loss": "Loss: tiny, seco, seq_len 600",
          "accuracy": "Retrieval accuracy vs key-query distance: tiny, seco, seq_len 600",
          "memory": "Memory by category over step 5: tiny, seco, seq_len 600"}
ns = "{http://www.w3.org/2000/svg}"
for name, title in titles.items():
    root = ET.parse(os.path.join(tmp, f"run.{name}.svg")).getroot()
    assert root.tag == ns + "svg", root.tag
    texts = [t.text for t in root.iter(ns + "text")]
    assert title in texts, (name, texts[:5])
    if name == "memory":
        legend = set(texts)
        assert {"weights", "activations", "kv_cache"} <= legend, texts
        assert len(list(root.iter(ns + "polygon"))) >= 4
    if name == "loss":
        assert "held-out eval" in texts and "train" in texts, texts
print("report OK:", r["loss_first"], "->", r["loss_last"], "eval", [round(e["loss"], 4) for e in r["evals"]])
PY

# Evaluating does not change training: the same run without evaluations has the same losses, every digit.
"$train" --model=tiny --strategy=seco --seq_len=600 --chunk=128 --steps=5 --report="$tmp/noeval.json" >/dev/null 2>&1 ||
  fail "train without evaluation"
/usr/bin/python3 - "$tmp/run.json" "$tmp/noeval.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert a["losses"] == b["losses"], (a["losses"], b["losses"])
assert b["evals"] == [] and all("eval" not in m for m in b["metrics"]), b["evals"]
assert b["plots"] == ["noeval.loss.svg", "noeval.memory.svg"], b["plots"]
print("evaluation leaves training unchanged")
PY

# A terminal (script(1) gives the command a pseudo-terminal): the progress line is rewritten in place and the
# evaluations print as lines of their own.
if command -v script >/dev/null && script -qec true /dev/null >/dev/null 2>&1; then
  script -qec "'$train' --model=tiny --seq_len=600 --chunk=128 --steps=5 --eval_every=2 --eval_sequences=2" \
    /dev/null >"$tmp/tty.txt" 2>&1 || { cat "$tmp/tty.txt"; fail "train on a terminal"; }
  grep -q $'\rstep 1/5  loss' "$tmp/tty.txt" || { cat -A "$tmp/tty.txt" | head; fail "no progress line on a terminal"; }
  grep -q $'\rstep 5/5  loss' "$tmp/tty.txt" || { cat -A "$tmp/tty.txt" | head; fail "no last progress line"; }
  grep -q "eval @ step 4: loss" "$tmp/tty.txt" || { cat -A "$tmp/tty.txt" | head; fail "no evaluation line on a terminal"; }
  grep -q "^done: 5 steps" "$tmp/tty.txt" || { cat -A "$tmp/tty.txt" | head; fail "no summary on a terminal"; }
  echo "terminal OK"
else
  echo "script(1) cannot open a pseudo-terminal here: terminal behaviour not checked"
fi

# Mamba: the same evaluation through its LM head.
"$train" --model=tiny-ssm "${common[@]}" --report="$tmp/ssm.json" >"$tmp/ssm.out" 2>&1 || { cat "$tmp/ssm.out"; fail "tiny-ssm"; }
/usr/bin/python3 - "$tmp/ssm.json" <<'PY'
import json, math, sys
r = json.load(open(sys.argv[1]))
e = r["evals"][-1]
assert e["step"] == 5 and e["tokens"] == 256 and math.isfinite(e["loss"]) and e["accuracy_by_distance"], e
print("tiny-ssm eval OK:", e["loss"], e["accuracy"])
PY

# Stopped early (--stop_at_step): the final evaluation and the memory timeline are those of the step it stops at.
"$train" --model=tiny "${common[@]}" --stop_at_step=3 --report="$tmp/stop.json" >"$tmp/stop.out" 2>&1 ||
  { cat "$tmp/stop.out"; fail "--stop_at_step"; }
/usr/bin/python3 - "$tmp/stop.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert [e["step"] for e in r["evals"]] == [2, 3], r["evals"]
assert r["memory_timeline"]["step"] == 3 and len(r["metrics"]) == 3, r["memory_timeline"]["step"]
print("stop_at_step OK")
PY

# --eval_data: a held-out JSONL file (evaluated after the last step even without --eval_every).
/usr/bin/python3 - "$tmp/heldout.jsonl" <<'PY'
import json, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for _ in range(3):
        f.write(json.dumps({"input_ids": [random.randrange(97) for _ in range(40)]}) + "\n")
PY
cp "$tmp/heldout.jsonl" "$tmp/train.jsonl"
# 40-token records at --seq_len=32: cut to 33 tokens (32 positions), in the training data and the held-out data.
"$train" --model=tiny --data="$tmp/train.jsonl" --seq_len=32 --overlong=truncate --steps=3 \
  --eval_data="$tmp/heldout.jsonl" --eval_sequences=0 --report="$tmp/file.json" >"$tmp/file.out" 2>&1 || { cat "$tmp/file.out"; fail "--eval_data"; }
grep -qF "train.jsonl (3 records; 3 truncated (21 tokens cut))" "$tmp/file.out" || { cat "$tmp/file.out"; fail "--overlong counts"; }
/usr/bin/python3 - "$tmp/file.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert [e["step"] for e in r["evals"]] == [3], r["evals"]
e = r["evals"][0]
assert e["sequences"] == 3 and e["tokens"] == 3 * 32 and "accuracy_by_distance" not in e, e
assert r["plots"] == ["file.loss.svg", "file.memory.svg"], r["plots"]
print("eval_data OK:", e)
PY

expect_error() {
  local name="$1" pattern="$2"; shift 2
  local rc=0
  "$train" --model=tiny --steps=1 "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || { cat "$tmp/$name.out"; fail "$name: exit $rc, want 1"; }
  grep -qF -- "$pattern" "$tmp/$name.out" || { cat "$tmp/$name.out"; fail "$name: no '$pattern' in the output"; }
  echo "$name: $(tail -1 "$tmp/$name.out")"
}
expect_error file_without_eval_data "--eval_every needs --eval_data" --data="$tmp/train.jsonl" --seq_len=40 --eval_every=1
expect_error negative_every "--eval_every must be >= 0" --seq_len=600 --eval_every=-1
expect_error missing_eval_data "--eval_data: " --seq_len=600 --eval_data="$tmp/nonexistent.jsonl"
expect_error dpo_eval "--objective=sft only" --objective=dpo --data="$dpo" --eval_every=1
echo "report train test OK"
