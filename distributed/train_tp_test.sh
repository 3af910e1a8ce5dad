#!/bin/bash
# cli:gradcheck --tp=2: grpo's gradient of the split model equals one process's (1e-12), dense and sparse.
# cli:train --tp: 2 ranks (TP = 2) train with the per-step losses of one process (fp64, 1e-10); 4 ranks as
# TP = 2 x DP = 2 too, also with ZeRO-1 over the data-parallel groups; a TP checkpoint resumes in one process and a
# one-process checkpoint under TP, both with the uninterrupted run's losses; --save writes the whole model, the same
# tensors as one process's; bad --tp values stop every rank at start with the numbers. Mamba (bench-ssm) the same way:
# seco and adjoint losses and --save of one process at TP = 2, TP = 2 x DP = 2, a TP checkpoint resumed in one
# process.
set -uo pipefail
train="$(pwd)/$1"
gradcheck="$(pwd)/$2"
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
# A private OpenMPI session and shared-memory directory (distributed/mpi_run_test.sh).
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
mpi=(timeout --signal=KILL 120 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader)
cd "${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*"; exit 1; }
same_losses() {  # same_losses A.json B.json STEPS
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))["losses"]; b = json.load(open(sys.argv[2]))["losses"]
print(sys.argv[1], a); print(sys.argv[2], b)
assert len(a) == len(b) == int(sys.argv[3]) and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
}
same_saved() {  # same_saved DIR_A DIR_B: the same tensors (fp64) in both model.safetensors
  /usr/bin/python3 - "$@" <<'PY'
import json, struct, sys
def tensors(path):
    raw = open(path, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return {k: (v["shape"], struct.unpack("<%dd" % (len(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) // 8),
                                     raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])) for k, v in head.items()}
a = tensors(sys.argv[1] + "/model.safetensors"); b = tensors(sys.argv[2] + "/model.safetensors")
assert a.keys() == b.keys(), (sorted(a), sorted(b))
worst = 0
for k in a:
    assert a[k][0] == b[k][0], k
    scale = max(abs(x) for x in a[k][1]) or 1
    worst = max(worst, max(abs(x - y) for x, y in zip(a[k][1], b[k][1])) / scale)
print("saved models: %d tensors, worst relative difference %.3g" % (len(a), worst))
assert worst <= 1e-10
PY
}
"${mpi[@]}" -np 2 "$gradcheck" --model=demo --dtype=f64 --tp=2 --strategy=seco --chunk=16 --page_size=8 --seq_len=64 \
  --sparse_sweep=0,2 --objective=grpo >gradcheck.json 2>gradcheck.log || { cat gradcheck.log; fail "gradcheck --tp=2"; }
/usr/bin/python3 - <<'PY' || fail "gradcheck --tp=2: gradients differ"
import json
rows = [json.loads(l) for l in open("gradcheck.json")]
print(rows)
assert len(rows) == 2 and all(r["tp"] == 2 and r["max_rel_err"] <= 1e-12 for r in rows)
PY
# demo: 4 heads over 2 KV heads, vocabulary 128, SwiGLU 176: splits over 2 ranks. Short windows of random tokens.
/usr/bin/python3 -c "
import random, struct
random.seed(3)
open('tokens.bin', 'wb').write(struct.pack('<2000H', *[random.randrange(128) for _ in range(2000)]))"
base=(--model=demo --dtype=f64 --data=tokens.bin --data_dtype=uint16 --seq_len=48 --batch=2 --steps=3 --chunk=16
      --page_size=8)
for strategy in seco streambp; do
  "$train" "${base[@]}" --strategy=$strategy --report=single.json --save=single_model >single.log 2>&1 \
    || { cat single.log; fail "$strategy: single process"; }
  "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "${base[@]}" --strategy=$strategy --report=tp.json --save=tp_model \
    >tp.log 2>&1 || { cat tp.log; fail "$strategy: --tp=2"; }
  grep -q "tensor parallel: 2 ranks per group" tp.log || { cat tp.log; fail "$strategy: no tensor-parallel summary"; }
  same_losses single.json tp.json 3 || fail "$strategy: --tp=2 losses differ"
  same_saved single_model tp_model || fail "$strategy: the saved models differ"
done
# LoRA with dropout on every linear layer (row-parallel o_proj/down_proj draw their masks at their columns).
lora=(--lora_rank=4 --lora_targets=all-linear --lora_dropout=0.2 --strategy=seco)
"$train" "${base[@]}" "${lora[@]}" --report=lora1.json >single.log 2>&1 || { cat single.log; fail "LoRA: one process"; }
"${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "${base[@]}" "${lora[@]}" --report=lora2.json >tp.log 2>&1 \
  || { cat tp.log; fail "LoRA: --tp=2"; }
same_losses lora1.json lora2.json 3 || fail "LoRA with dropout: --tp=2 losses differ"
# TP = 2 x DP = 2 on 4 ranks: the losses of one process on the same batches.
"$train" "${base[@]}" --strategy=seco --batch=4 --report=single4.json >single.log 2>&1 || fail "single process, batch 4"
"${mpi[@]}" -np 4 "$train" --dist=mpi --tp=2 "${base[@]}" --strategy=seco --batch=4 --report=grid.json >grid.log 2>&1 \
  || { cat grid.log; fail "--tp=2 on 4 ranks"; }
grep -q "tensor parallel: 2 groups of 2 ranks" grid.log || { cat grid.log; fail "no 2 x 2 grid"; }
same_losses single4.json grid.json 3 || fail "TP x DP losses differ"
"${mpi[@]}" -np 4 "$train" --dist=mpi --tp=2 --dist_shard_optimizer "${base[@]}" --strategy=seco --batch=4 \
  --report=zero.json >grid.log 2>&1 || { cat grid.log; fail "--tp=2 with ZeRO-1 on 4 ranks"; }
same_losses single4.json zero.json 3 || fail "TP x DP with ZeRO-1: losses differ"
# --memory_budget plans one rank of the split model (its MetaTwin) and picks the chunk.
"${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "${base[@]}" --strategy=seco --memory_budget=2300000 >budget.log 2>&1 \
  || { cat budget.log; fail "--tp=2 --memory_budget"; }
grep -q "memory budget 2.2 MiB: --chunk=32 " budget.log || { cat budget.log; fail "--memory_budget: no chunk picked"; }
# Checkpoints: TP -> one process, and one process -> TP, each with the straight run's losses.
checkpoints_both_ways() {  # checkpoints_both_ways WHAT TRAIN_ARGS... (4 steps, checkpoints at step 2)
  local what="$1"; shift
  rm -rf ck_a ck_b
  "$train" "$@" --report=straight.json >single.log 2>&1 || fail "$what: straight run"
  "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "$@" --out_dir=ck_a --stop_at_step=2 >tp.log 2>&1 \
    || { cat tp.log; fail "$what: TP checkpoint"; }
  "$train" "$@" --out_dir=ck_a --resume --report=a.json >resume.log 2>&1 || { cat resume.log; fail "$what: resume in one process"; }
  same_losses straight.json a.json 4 || fail "$what: TP checkpoint -> one process: losses differ"
  "$train" "$@" --out_dir=ck_b --stop_at_step=2 >single.log 2>&1 || fail "$what: one-process checkpoint"
  "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "$@" --out_dir=ck_b --resume --report=b.json >tp.log 2>&1 \
    || { cat tp.log; fail "$what: resume under TP"; }
  same_losses straight.json b.json 4 || fail "$what: one-process checkpoint -> TP: losses differ"
}
checkpoints_both_ways demo "${base[@]}" --steps=4 --strategy=seco
# Mamba (bench-ssm: d_inner 512, vocabulary 512), the d_inner channels split: seco and the exact adjoint at TP = 2
# with one process's losses and saved model, TP = 2 x DP = 2, checkpoints across TP and one process both ways.
ssm=(--model=bench-ssm --dtype=f64 --data=tokens.bin --data_dtype=uint16 --seq_len=48 --batch=2 --steps=3 --chunk=16)
for strategy in seco adjoint; do
  "$train" "${ssm[@]}" --strategy=$strategy --report=ssm1.json --save=ssm1_model >single.log 2>&1 \
    || { cat single.log; fail "Mamba $strategy: one process"; }
  "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 "${ssm[@]}" --strategy=$strategy --report=ssm2.json --save=ssm2_model \
    >tp.log 2>&1 || { cat tp.log; fail "Mamba $strategy: --tp=2"; }
  same_losses ssm1.json ssm2.json 3 || fail "Mamba $strategy: --tp=2 losses differ"
  same_saved ssm1_model ssm2_model || fail "Mamba $strategy: the saved models differ"
done
"$train" "${ssm[@]}" --strategy=seco --batch=4 --report=ssm4.json >single.log 2>&1 || fail "Mamba: one process, batch 4"
"${mpi[@]}" -np 4 "$train" --dist=mpi --tp=2 "${ssm[@]}" --strategy=seco --batch=4 --report=ssm_grid.json >grid.log 2>&1 \
  || { cat grid.log; fail "Mamba: --tp=2 on 4 ranks"; }
same_losses ssm4.json ssm_grid.json 3 || fail "Mamba: TP x DP losses differ"
checkpoints_both_ways bench-ssm "${ssm[@]}" --steps=4 --strategy=seco
# Bad input, refused at start on every rank with the numbers: a vocabulary of 97 (tiny), a world size that is not
# tp x dp, ranks disagreeing on --tp.
expect_error() {  # expect_error TEXT CMD...
  local text="$1"; shift
  out=$("$@" 2>&1); rc=$?
  grep -m3 -e "--tp" <<<"$out"
  [[ $rc -ne 0 ]] || fail "accepted: $*"
  # A here-string, not a pipe: grep -q stops at the first match and, under pipefail, echo's SIGPIPE failed the test.
  grep -qF -- "$text" <<<"$out" || { echo "$out"; fail "no '$text'"; }
}
expect_error "vocab_size=97 is not divisible by 2" "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 --model=tiny --steps=1
expect_error "the job has 2 ranks, which is not tp (3)" "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=3 --model=demo --steps=1
expect_error "--tp differs across ranks (rank 0: 2, rank 1: 1)" "${mpi[@]}" -np 1 "$train" --dist=mpi --tp=2 \
  --model=demo --steps=1 : -np 1 "$train" --dist=mpi --model=demo --steps=1
expect_error "exceeds num_key_value_heads=2" "${mpi[@]}" -np 4 "$train" --dist=mpi --tp=4 --model=demo --steps=1
expect_error "--tp: needs --dist=mpi or --dist=nccl" "$train" --tp=2 --model=demo --steps=1
# tiny-ssm: vocabulary 97; its d_inner (32) splits over 2 but not over 3.
expect_error "vocab_size=97 is not divisible by 2" "${mpi[@]}" -np 2 "$train" --dist=mpi --tp=2 --model=tiny-ssm --steps=1
expect_error "intermediate_size=512 is not divisible by 3" "${mpi[@]}" -np 3 "$train" --dist=mpi --tp=3 \
  --model=bench-ssm --steps=1
echo PASS
