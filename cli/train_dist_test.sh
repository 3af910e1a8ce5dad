#!/bin/bash
# --dist=mpi: 2 ranks (mpirun on loopback) train with the per-step losses of one process on the same batches
# (fp64, to 1e-10), also with --dist_layers and --dist_shard_optimizer, a 2-rank checkpoint resumes in one process, and ranks started with different options stop at once with the configuration error.
set -uo pipefail
train="$(pwd)/$1"
build="${2:-cpu}"  # cpu: --dist=nccl must be refused (built without --config=cuda); cuda: see train_nccl_gpu_test
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
# A private OpenMPI session and shared-memory directory: parallel test sandboxes share /tmp and /dev/shm and may
# reuse PIDs (distributed/mpi_run_test.sh).
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
mpi=(timeout --signal=KILL 120 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader)
cd "${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*"; exit 1; }
for strategy in full seco streambp; do
  args=(--model=tiny --dtype=f64 --seq_len=560 --batch=3 --steps=3 --strategy=$strategy --chunk=128)
  "$train" "${args[@]}" --report=single.json >single.log 2>&1 || { cat single.log; fail "$strategy: single process"; }
  "${mpi[@]}" -np 2 "$train" --dist=mpi "${args[@]}" --report=dist.json >dist.log 2>&1 || { cat dist.log; fail "$strategy: mpirun"; }
  grep -q "data parallel: 2 ranks" dist.log || { cat dist.log; fail "$strategy: no data-parallel summary"; }
  /usr/bin/python3 - <<'PY' || fail "$strategy: losses differ"
import json
a = json.load(open("single.json"))["losses"]; b = json.load(open("dist.json"))["losses"]
print("single", a); print("2 ranks", b)
assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
done
# --dist_layers (layer-sharded adjoint, tiny-ssm: 3 layers on 2 ranks) and --dist_shard_optimizer (ZeRO-1): the
# losses of one process.
for extra in "--dist_layers --model=tiny-ssm --strategy=adjoint --adjoint_window=96" \
             "--dist_shard_optimizer --model=tiny --strategy=seco"; do
  read -r flag model strat window <<<"$extra"
  args=(--dtype=f64 --seq_len=560 --batch=3 --steps=3 --chunk=128 $model $strat $window)
  "$train" "${args[@]}" --report=single.json >single.log 2>&1 || { cat single.log; fail "$flag: single process"; }
  "${mpi[@]}" -np 2 "$train" --dist=mpi $flag "${args[@]}" --report=dist.json >dist.log 2>&1 || { cat dist.log; fail "$flag: mpirun"; }
  grep -Eq "layer-sharded adjoint: 2 ranks|optimizer state sharded" dist.log || { cat dist.log; fail "$flag: not used"; }
  /usr/bin/python3 - <<'PY' || { cat dist.log; fail "$flag: losses differ"; }
import json
a = json.load(open("single.json"))["losses"]; b = json.load(open("dist.json"))["losses"]
print("single", a); print("2 ranks", b)
assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
done
# A checkpoint written by 2 ranks resumes in one process with the uninterrupted run's losses.
args=(--model=tiny --dtype=f64 --seq_len=560 --batch=3 --steps=4 --strategy=seco --chunk=128)
"${mpi[@]}" -np 2 "$train" --dist=mpi "${args[@]}" --out_dir=ck --stop_at_step=2 >dist.log 2>&1 || { cat dist.log; fail "2-rank checkpoint"; }
"$train" "${args[@]}" --out_dir=ck --resume --report=resumed.json >resume.log 2>&1 || { cat resume.log; fail "resume"; }
"$train" "${args[@]}" --report=straight.json >single.log 2>&1 || fail "straight run"
/usr/bin/python3 - <<'PY' || fail "resumed losses differ"
import json
a = json.load(open("straight.json"))["losses"]; b = json.load(open("resumed.json"))["losses"]
print("straight", a); print("2 ranks + resume", b)
assert len(a) == len(b) == 4 and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))
PY
# Different --chunk on rank 1: both ranks refuse at start.
out=$("${mpi[@]}" -np 1 "$train" --dist=mpi --model=tiny --seq_len=560 --steps=2 --strategy=seco --chunk=128 : \
      -np 1 "$train" --dist=mpi --model=tiny --seq_len=560 --steps=2 --strategy=seco --chunk=64 2>&1)
rc=$?
echo "$out" | head -20
[[ $rc -ne 0 ]] || fail "mismatched ranks: the job succeeded"
grep -q "configuration differs across ranks" <<<"$out" || fail "mismatched ranks: no configuration error"
grep -q "strategy.chunk: rank 1 '64', rank 0 '128'" <<<"$out" || fail "mismatched ranks: the field is not named"
# --dist=nccl in a build without --config=cuda: refused at once with an error that says so (no MPI needed).
if [[ "$build" == cpu ]]; then
  out=$(timeout --signal=KILL 60 "$train" --dist=nccl --model=tiny --seq_len=560 --steps=1 2>&1)
  rc=$?
  echo "$out" | head -5
  [[ $rc -ne 0 ]] || fail "--dist=nccl without CUDA: succeeded"
  grep -q "built without --config=cuda" <<<"$out" || fail "--dist=nccl without CUDA: no clear error"
  grep -q -- "--dist=nccl" <<<"$out" || fail "--dist=nccl without CUDA: the flag is not named"
fi
echo PASS
