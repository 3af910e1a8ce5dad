#!/usr/bin/env bash
# cli:score: JSONL aligned with input_ids (null where nothing is predicted), the same values at any chunk size,
# dpo sums and grpo arrays equal to the sft scores of the same tokens, and grpo's reference log-probs from score
# train exactly as --ref_model does. Also --help (every flag, exit 0) and --threads of every tool, and their
# passive OpenMP wait policy.
# usage: score_test.sh <score> <train> <bench> <gradcheck> <dpo_tiny.jsonl> <grpo_tiny.jsonl>
set -euo pipefail
score="$1" train="$2" bench="$3" gradcheck="$4" dpo="$5" grpo="$6"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

# sft records: HF labels (a masked prompt), next-token records (no labels), and a .bin file.
cat >"$tmp/sft.jsonl" <<'EOF'
{"input_ids": [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], "labels": [-100, -100, -100, -100, 21, 25, 29, -100, 37, 41, 45, 49]}
{"input_ids": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
EOF
/usr/bin/python3 -c "import struct,sys; open(sys.argv[1],'wb').write(struct.pack('<20H', *range(10, 30)))" "$tmp/t.bin"
"$score" --model=tiny --dtype=f64 --data="$tmp/sft.jsonl" --chunk=512 --out="$tmp/whole.jsonl" 2>"$tmp/err"
grep -q "seqgrad score: 2 records, 17 tokens" "$tmp/err" || { cat "$tmp/err"; exit 1; }
"$score" --model=tiny --dtype=f64 --data="$tmp/sft.jsonl" --strategy=seco --chunk=3 --lm_chunk=2 --threads=1 \
  >"$tmp/chunked.jsonl" 2>/dev/null
"$score" --model=tiny --dtype=f64 --data="$tmp/t.bin" --seq_len=9 --out="$tmp/bin.jsonl" 2>/dev/null
# grpo: the prompt + completions as sft records with the prompt masked, to compare; a reference model that differs
# from the policy (tiny after a few sft steps).
"$train" --model=tiny --dtype=f64 --steps=3 --seq_len=32 --data="$tmp/sft.jsonl" --save="$tmp/ref_model" >/dev/null 2>&1
"$score" --model="$tmp/ref_model" --dtype=f64 --objective=grpo --data="$grpo" --out="$tmp/grpo_scores.jsonl" 2>/dev/null
"$score" --model="$tmp/ref_model" --dtype=f64 --objective=dpo --data="$dpo" --out="$tmp/dpo_scores.jsonl" 2>/dev/null
/usr/bin/python3 - "$tmp" "$grpo" "$dpo" <<'PY'
import json, math, sys
tmp, grpo, dpo = sys.argv[1:]
load = lambda p: [json.loads(l) for l in open(p)]
recs, whole, chunked = load(f"{tmp}/sft.jsonl"), load(f"{tmp}/whole.jsonl"), load(f"{tmp}/chunked.jsonl")
for rec, w, c in zip(recs, whole, chunked):
    labels = rec.get("labels", rec["input_ids"])
    lp = w["logprobs"]
    assert len(lp) == len(rec["input_ids"]), (len(lp), rec)
    for t, (x, y) in enumerate(zip(lp, c["logprobs"])):
        predicted = t > 0 and labels[t] != -100
        assert (x is not None) == predicted and (y is not None) == predicted, (t, x, y)
        if predicted:
            assert x < 0 and abs(x - y) <= 1e-12 * abs(x), (t, x, y)
    assert w["tokens"] == sum(x is not None for x in lp)
    assert abs(w["sum"] - sum(x for x in lp if x is not None)) <= 1e-12 * abs(w["sum"])
assert whole[0]["tokens"] == 7 and whole[1]["tokens"] == 10
b = load(f"{tmp}/bin.jsonl")  # 20 tokens in windows of 10 that share their boundary token, the last one ragged
assert [len(r["logprobs"]) for r in b] == [10, 10, 2] and b[0]["logprobs"][0] is None and b[0]["tokens"] == 9, b

# grpo arrays and dpo sums: the same values as sft records over the same tokens.
sft, expect = [], []
for g, s in zip(load(grpo), load(f"{tmp}/grpo_scores.jsonl")):
    assert [len(x) for x in s["logprobs"]] == [len(c) for c in g["completions"]]
    for c, lp in zip(g["completions"], s["logprobs"]):
        sft.append({"input_ids": g["prompt"] + c, "labels": [-100] * len(g["prompt"]) + c})
        expect.append(("grpo", lp))
for p, s in zip(load(dpo), load(f"{tmp}/dpo_scores.jsonl")):
    for k in ("chosen", "rejected"):
        sft.append({"input_ids": p["prompt"] + p[k], "labels": [-100] * len(p["prompt"]) + p[k]})
        expect.append(("dpo", s[f"{k}_logp"]))
with open(f"{tmp}/cross.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in sft)
with open(f"{tmp}/expect.json", "w") as f:
    json.dump(expect, f)
# grpo with reference log-probs from score equals grpo with the reference model itself.
with open(f"{tmp}/grpo_with_ref.jsonl", "w") as f:
    for g, s in zip(load(grpo), load(f"{tmp}/grpo_scores.jsonl")):
        g = dict(g)
        g.pop("old_logprobs", None)
        g["ref_logprobs"] = s["logprobs"]
        f.write(json.dumps(g) + "\n")
    without = [dict(g) for g in load(grpo)]
with open(f"{tmp}/grpo_no_ref.jsonl", "w") as f:
    for g in without:
        g.pop("old_logprobs", None)
        g.pop("ref_logprobs", None)
        f.write(json.dumps(g) + "\n")
PY
"$score" --model="$tmp/ref_model" --dtype=f64 --data="$tmp/cross.jsonl" --out="$tmp/cross_scores.jsonl" 2>/dev/null
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
scores = [json.loads(l) for l in open(f"{tmp}/cross_scores.jsonl")]
for (kind, want), s in zip(json.load(open(f"{tmp}/expect.json")), scores):
    got = [x for x in s["logprobs"] if x is not None]
    if kind == "grpo":
        assert len(got) == len(want) and all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(got, want)), (got, want)
    else:
        assert abs(s["sum"] - want) <= 1e-12 * abs(want), (s["sum"], want)
PY
for ref in "--data=$tmp/grpo_with_ref.jsonl" "--data=$tmp/grpo_no_ref.jsonl --ref_model=$tmp/ref_model"; do
  # shellcheck disable=SC2086
  "$train" --model=tiny --dtype=f64 --objective=grpo $ref --steps=2 --batch=2 --strategy=seco --chunk=4 \
    --report="$tmp/r.json" >/dev/null 2>&1
  /usr/bin/python3 -c "import json,sys; print(' '.join('%.17g' % x for x in json.load(open(sys.argv[1]))['losses']))" \
    "$tmp/r.json" >>"$tmp/grpo_losses"
done
/usr/bin/python3 - "$tmp/grpo_losses" <<'PY'
import sys
a, b = [list(map(float, l.split())) for l in open(sys.argv[1])]
assert abs(a[0]) > 1e-4, a  # the KL term to a reference that differs from the policy
assert all(abs(x - y) <= 1e-12 * max(1, abs(y)) for x, y in zip(a, b)), (a, b)
PY

# --doc_sep_token: a .bin of documents, each ending with the separator 2, scores as its documents alone (whole, and
# in chunks that cut documents); training on it runs.
/usr/bin/python3 - "$tmp" <<'PY'
import json, struct, sys
tmp = sys.argv[1]
docs = [[10, 11, 12, 13, 14, 2], [20, 21, 22, 2], [30, 31, 32, 33, 34, 35, 36]]
tokens = sum(docs, [])
open(f"{tmp}/docs.bin", "wb").write(struct.pack("<%dH" % len(tokens), *tokens))
with open(f"{tmp}/docs_alone.jsonl", "w") as f:
    f.writelines(json.dumps({"input_ids": d}) + "\n" for d in docs)
PY
"$score" --model=tiny --dtype=f64 --data="$tmp/docs_alone.jsonl" --out="$tmp/alone.jsonl" 2>/dev/null
"$score" --model=tiny --dtype=f64 --data="$tmp/docs.bin" --seq_len=64 --doc_sep_token=2 --out="$tmp/sep.jsonl" \
  2>/dev/null
"$score" --model=tiny --dtype=f64 --data="$tmp/docs.bin" --seq_len=64 --doc_sep_token=2 --strategy=seco --chunk=3 \
  --page_size=2 --out="$tmp/sep_chunked.jsonl" 2>/dev/null
"$score" --model=tiny --dtype=f64 --data="$tmp/docs.bin" --seq_len=64 --out="$tmp/stream.jsonl" 2>/dev/null
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
load = lambda p: [json.loads(l) for l in open(p)]
alone = sum((r["logprobs"] for r in load(f"{tmp}/alone.jsonl")), [])
for name in ("sep", "sep_chunked"):
    (packed,) = load(f"{tmp}/{name}.jsonl")
    got = packed["logprobs"]
    assert len(got) == len(alone) and [x is None for x in got] == [x is None for x in alone], (name, got, alone)
    assert all(x is None or abs(x - y) <= 1e-12 * abs(y) for x, y in zip(got, alone)), (name, got, alone)
(stream,) = load(f"{tmp}/stream.jsonl")  # without the flag: one stream, attending across documents
assert stream["tokens"] == len(alone) - 1 and abs(stream["logprobs"][8] - alone[8]) > 1e-6, stream
PY
"$train" --model=tiny --steps=1 --seq_len=8 --data="$tmp/docs.bin" --doc_sep_token=2 >/dev/null 2>"$tmp/err" ||
  { cat "$tmp/err"; exit 1; }
rc=0
"$train" --model=tiny --steps=1 --seq_len=8 --data="$tmp/docs.bin" --doc_sep_token=100000 >/dev/null 2>"$tmp/err" ||
  rc=$?
[ "$rc" = 1 ] && grep -qF -- "--doc_sep_token=100000 is outside the vocabulary" "$tmp/err" ||
  { cat "$tmp/err"; exit 1; }

# A resume with another thread count continues, warned that it is no longer bit-identical.
"$train" --model=tiny --steps=2 --seq_len=16 --data="$tmp/sft.jsonl" --threads=1 --out_dir="$tmp/run" \
  --stop_at_step=1 >/dev/null 2>&1
"$train" --model=tiny --steps=2 --seq_len=16 --data="$tmp/sft.jsonl" --threads=2 --out_dir="$tmp/run" --resume \
  >/dev/null 2>"$tmp/resume.err"
grep -q "warning: --resume: runtime.threads: checkpoint '1', now '2'" "$tmp/resume.err" ||
  { cat "$tmp/resume.err"; exit 1; }

# Bad input names the flag.
expect_error() {  # expect_error NEEDLE ARGS...: exit 1 with NEEDLE on stderr
  local needle="$1" rc=0
  shift
  "$score" "$@" >/dev/null 2>"$tmp/err" || rc=$?
  [ "$rc" = 1 ] && grep -qF -- "$needle" "$tmp/err" || { echo "expected '$needle' (rc $rc):"; cat "$tmp/err"; exit 1; }
}
expect_error "--data: is required" --model=tiny
expect_error "--seq_len: a .bin token file needs --seq_len" --model=tiny --data="$tmp/t.bin"
expect_error "--threads: got -2" --model=tiny --data="$tmp/sft.jsonl" --threads=-2
expect_error "--data" --model=tiny --data="$tmp/missing.jsonl"

# Every tool: --help lists every flag the tool defines (all but Abseil's own, which --helpfull adds) and exits 0.
for tool in "$score" "$train" "$bench" "$gradcheck"; do
  "$tool" --help >"$tmp/help" 2>&1 || { echo "$tool --help failed"; exit 1; }
  "$tool" --helpfull >"$tmp/helpfull" 2>&1 || true
  own=$(grep -oE '^    --[a-z_0-9]+ ' "$tmp/helpfull" | tr -d ' -' | sort -u |
        grep -vxE 'flagfile|fromenv|tryfromenv|undefok|help|helpfull|helpmatch|helpon|helppackage|helpshort|only_check_args|version')
  for f in $own threads; do grep -q -- "^  --$f " "$tmp/help" || { echo "$tool --help lacks --$f"; exit 1; }; done
done

# The tools wait passively unless the user chose a policy; --threads sets the thread count.
for policy in unset active; do
  if [ "$policy" = unset ]; then env=(env -u OMP_WAIT_POLICY); else env=(env OMP_WAIT_POLICY=active); fi
  "${env[@]}" "$bench" --model=tiny --strategies=full --seq_lens=16 --repeats=1 --warmup=0 --threads=2 \
    --json="$tmp/b_$policy.json" >/dev/null 2>&1
done
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
for policy, want in (("unset", "PASSIVE"), ("active", "active")):
    c = json.load(open(f"{tmp}/b_{policy}.json"))["config"]
    assert c["omp_wait_policy"] == want and c["threads"] == 2, c
PY
echo "score_test: OK"
