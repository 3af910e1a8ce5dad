#!/usr/bin/env bash
# //cli:train's checkpoints, resume, optimizer flags and guard rails, on CPU with a fixed seed:
#   - resume equals uninterrupted: 6 steps straight vs 3 steps (--steps=6 --stop_at_step=3) + --resume give the same
#     per-step losses in the --report JSON, compared exactly (%.17g), for spaco (its sampling stream is restored),
#     dpo with --grad_accum=2 and a cosine schedule with warmup, a Mamba model with seco, and LoRA with dropout;
#   - a damaged newest checkpoint is skipped with a warning and the run resumes from the one before, still exact;
#   - a resume whose configuration differs is refused, listing the fields; an out_dir holding checkpoints without
#     --resume is refused; --keep_checkpoints; the final model in --out_dir loads back (--model=<out_dir>);
#   - --grad_accum=2 --batch=2 equals --batch=4 exactly;
#   - --memory_budget picks a chunk that fits, or refuses before training with needed vs budget bytes;
#   - bad flags name the flag.
# usage: train_checkpoint_test.sh <train binary> <dpo_tiny.jsonl>
set -euo pipefail
train="$1"; dpo="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

fail() { echo "FAIL: $*" >&2; exit 1; }

# t NAME [FLAGS...]: runs train (must exit 0), output in $tmp/NAME.out.
t() {
  local name="$1"; shift
  local rc=0
  "$train" "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || { cat "$tmp/$name.out"; fail "$name: train exited with $rc"; }
}
# refused NAME EXPECTED [FLAGS...]: train must exit non-zero with EXPECTED (a fixed string) in its output.
refused() {
  local name="$1" expected="$2"; shift 2
  local rc=0
  "$train" "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] || { cat "$tmp/$name.out"; fail "$name: train exited 0"; }
  grep -qF -- "$expected" "$tmp/$name.out" || { cat "$tmp/$name.out"; fail "$name: no '$expected' in the output"; }
}
# same_losses A.json B.json: the two reports' losses are identical, every digit.
same_losses() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert len(a["losses"]) == len(b["losses"]) > 0, (a["losses"], b["losses"])
assert a["losses"] == b["losses"], ("losses differ", a["losses"], b["losses"])
print(f"{sys.argv[2]}: {len(a['losses'])} losses identical, last {a['losses'][-1]!r}")
PY
}

# resume_case NAME [FLAGS...]: 6 steps straight == 3 steps (--stop_at_step), then --resume to 6.
resume_case() {
  local name="$1"; shift
  t "$name.straight" "$@" --steps=6 --out_dir="$tmp/$name.straight" --report="$tmp/$name.straight.json"
  t "$name.first" "$@" --steps=6 --stop_at_step=3 --out_dir="$tmp/$name.resumed" --save_every=2 \
    --report="$tmp/$name.first.json"
  [ ! -e "$tmp/$name.resumed/model.safetensors" ] || fail "$name: a final model after --stop_at_step"
  [ -d "$tmp/$name.resumed/checkpoint-3" ] || fail "$name: no checkpoint-3 after 3 steps"
  t "$name.second" "$@" --steps=6 --out_dir="$tmp/$name.resumed" --save_every=2 --resume \
    --report="$tmp/$name.resumed.json"
  grep -qF "resumed from $tmp/$name.resumed/checkpoint-3: step 3 of 6" "$tmp/$name.second.out" ||
    { cat "$tmp/$name.second.out"; fail "$name: did not resume from checkpoint-3"; }
  same_losses "$tmp/$name.straight.json" "$tmp/$name.resumed.json"
}

SFT=(--model=tiny --seq_len=600 --seed=3)
resume_case spaco "${SFT[@]}" --strategy=spaco --chunk=128 --spaco_budget=2
resume_case dpo --model=tiny --objective=dpo --data="$dpo" --strategy=seco --chunk=8 --batch=2 --grad_accum=2 \
  --lr_schedule=cosine --warmup_steps=2 --min_lr=1e-4
resume_case mamba --model=tiny-ssm --seq_len=600 --strategy=seco --chunk=100 --lr_schedule=linear
resume_case lora "${SFT[@]}" --strategy=seco --chunk=128 --lora_rank=4 --lora_dropout=0.1

# Checkpoints kept (default 2: the newest), the final model next to them.
ls "$tmp/spaco.resumed" | sort | tr '\n' ' ' >"$tmp/spaco.ls"
[ "$(cat "$tmp/spaco.ls")" = "checkpoint-4 checkpoint-6 config.json model.safetensors " ] ||
  fail "spaco out_dir holds: $(cat "$tmp/spaco.ls")"
t reload --model="$tmp/spaco.resumed" --seq_len=600 --steps=1
t keep1 "${SFT[@]}" --steps=4 --save_every=1 --keep_checkpoints=1 --out_dir="$tmp/keep1"
[ "$(ls -d "$tmp"/keep1/checkpoint-* | wc -l)" = 1 ] && [ -d "$tmp/keep1/checkpoint-4" ] || fail "keep_checkpoints=1"

# A damaged newest checkpoint: skipped with the reason, resumed from the previous one, still exact.
mkdir -p "$tmp/damaged"
t damaged.first "${SFT[@]}" --strategy=spaco --chunk=128 --spaco_budget=2 --steps=5 --save_every=2 \
  --out_dir="$tmp/damaged"
truncate -s 100 "$tmp/damaged/checkpoint-5/optimizer.safetensors"
t damaged.second "${SFT[@]}" --strategy=spaco --chunk=128 --spaco_budget=2 --steps=6 --save_every=2 \
  --out_dir="$tmp/damaged" --resume --report="$tmp/damaged.json"
grep -qF "warning: --resume: skipping $tmp/damaged/checkpoint-5/optimizer.safetensors: truncated" \
  "$tmp/damaged.second.out" || { cat "$tmp/damaged.second.out"; fail "damaged: no warning"; }
grep -qF "resumed from $tmp/damaged/checkpoint-4: step 4 of 6" "$tmp/damaged.second.out" || fail "damaged: not from 4"
same_losses "$tmp/spaco.straight.json" "$tmp/damaged.json"

# A different configuration is refused with the fields; so is an out_dir with checkpoints and no --resume.
refused mismatch "different configuration (3 fields differ)" "${SFT[@]}" --strategy=spaco --chunk=64 \
  --spaco_budget=2 --steps=8 --lr=1e-3 --batch=2 --out_dir="$tmp/spaco.resumed" --resume
for field in "strategy.chunk: checkpoint '128', now '64'" "optimizer.lr: checkpoint '0.003', now '0.001'" \
  "batch: checkpoint '1', now '2'"; do
  grep -qF "$field" "$tmp/mismatch.out" || { cat "$tmp/mismatch.out"; fail "mismatch: no '$field'"; }
done
refused model_mismatch "model.model_type: checkpoint 'llama', now 'qwen2'" --model=tiny-qwen2 --seq_len=600 --seed=3 \
  --strategy=spaco --chunk=128 --spaco_budget=2 --steps=8 --out_dir="$tmp/spaco.resumed" --resume
refused no_resume "already holds $tmp/spaco.resumed/checkpoint-6: pass --resume" "${SFT[@]}" \
  --out_dir="$tmp/spaco.resumed" --steps=2

# Gradient accumulation: 2 micro-batches of 2 sequences = one batch of 4, exactly.
t accum "${SFT[@]}" --strategy=seco --chunk=128 --steps=3 --batch=2 --grad_accum=2 --report="$tmp/accum.json"
t big "${SFT[@]}" --strategy=seco --chunk=128 --steps=3 --batch=4 --report="$tmp/big.json"
same_losses "$tmp/big.json" "$tmp/accum.json"

# --memory_budget: the largest chunk that fits (and the run stays within it), or a refusal before training.
t budget --model=demo --seq_len=2048 --strategy=seco --steps=1 --memory_budget=6000000 --report="$tmp/budget.json"
grep -qE "memory budget 5.7 MiB: --chunk=[0-9]+ \(peak" "$tmp/budget.out" || { cat "$tmp/budget.out"; fail "budget"; }
/usr/bin/python3 - "$tmp/budget.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert 16 <= r["chunk"] < 2048 and r["peak_bytes"] <= 6000000, r
print(f"budget: chunk {r['chunk']}, peak {r['peak_bytes']} <= 6000000")
PY
t budget_streambp --model=demo --seq_len=2048 --strategy=streambp --steps=1 --memory_budget=100000000
grep -qF -- "--chunk=2048 (peak" "$tmp/budget_streambp.out" || { cat "$tmp/budget_streambp.out"; fail "budget 2"; }
refused budget_small "on a sequence of 2048 tokens needs " --model=demo --seq_len=2048 --strategy=seco --steps=1 \
  --memory_budget=2000000
grep -qF "but the budget is 2000000 bytes" "$tmp/budget_small.out" || fail "budget_small: no budget"
grep -qF "done:" "$tmp/budget_small.out" && fail "budget_small trained"
refused budget_full "--strategy=full on a sequence of 2048 tokens needs " --model=demo --seq_len=2048 \
  --strategy=full --steps=1 --memory_budget=4000000
refused budget_weights "is below what the model holds before any step" --model=demo --seq_len=2048 --steps=1 \
  --memory_budget=1000

# Bad flags.
refused bad_schedule "--lr_schedule 'step' is not known" --lr_schedule=step
refused bad_warmup "--steps must be larger" --lr_schedule=cosine --warmup_steps=10 --steps=10
refused bad_min_lr "--min_lr is 1; need 0 <= min_lr <= lr" --min_lr=1 --lr=0.1
refused bad_accum "--grad_accum is 0" --grad_accum=0
refused bad_resume "--resume needs --out_dir" --resume
refused bad_save_every "--save_every must be >= 0" --save_every=-1 --out_dir="$tmp/x"
refused bad_keep "--keep_checkpoints must be >= 0" --keep_checkpoints=-1
refused bad_stop "--stop_at_step must be >= 0" --stop_at_step=-2
echo PASS
