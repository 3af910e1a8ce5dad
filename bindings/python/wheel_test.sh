#!/bin/bash
# The wheel is self-contained: a manylinux tag, no RUNPATH into Bazel's tree or /usr, and it installs into a fresh
# venv of its CPython without system site packages (NumPy 2 from PyPI) and trains with Debian's copies of the
# libraries it bundles hidden from the loader (tools/hide_system_libs.sh), also with tp=2 under mpirun -np 2 (the
# system's OpenMPI). Its `seqgrad` console script runs the same tools as Bazel's: plan prints the same plan, train
# the same losses.
# usage: wheel_test.sh WHEEL NUMPY2_DIR HIDE_SYSTEM_LIBS PYTHON PLAN TRAIN
#   NUMPY2_DIR: PyPI's NumPy 2 for that CPython, pip-installed by ./bazelw; PYTHON: the CPython the wheel is for;
#   PLAN, TRAIN: the Bazel-built //cli:plan and //cli:train.
set -euo pipefail
whl="$(readlink -f "$1")"
numpy2="$2"
hide="$(readlink -f "$3")"
python="$4"
plan="$(readlink -f "$5")"
train="$(readlink -f "$6")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

tag="$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
if [[ "$(basename "$whl")" != seqgrad-*-$tag-$tag-manylinux_*_x86_64.whl ]]; then
  echo "FAIL: $(basename "$whl") is not a manylinux wheel for $tag ($python)" >&2
  exit 1
fi

mkdir "$tmp/unpacked"
/usr/bin/python3 -m zipfile -e "$whl" "$tmp/unpacked"
while IFS= read -r so; do
  runpath="$(readelf -d "$so" | grep -E 'R(UN)?PATH' || true)"
  if [[ "$runpath" =~ /usr|_solib|bazel|execroot ]]; then
    echo "FAIL: ${so#"$tmp"/unpacked/} has $runpath" >&2
    exit 1
  fi
done < <(find "$tmp/unpacked" -name '*.so*')

"$python" -m venv "$tmp/venv"  # no system site packages: Debian's NumPy, torch, ... are not there
site="$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')"
echo "$numpy2" >"$site/numpy2.pth"
# pip checks Requires-Dist numpy>=1.24,<3 against that NumPy 2 (offline: nothing else may be needed).
"$tmp/venv/bin/python" -m pip install --quiet --no-index "$whl"

cat >"$tmp/check.py" <<'PY'
import ctypes
import importlib.metadata
import os
import sys

for name in ("libgomp.so.1", "libopenblas.so.0", "libabsl_base.so.20220623", "libgfortran.so.5", "libquadmath.so.0"):
    try:
        ctypes.CDLL(name)
        sys.exit("FAIL: Debian's %s still loads" % name)
    except OSError:
        pass  # hidden: "file too short"

import numpy as np
import seqgrad

assert np.__version__.startswith("2."), np.__version__
assert importlib.metadata.version("seqgrad") == seqgrad.__version__ == seqgrad.version()  # one version source
# seqgrad[data]: seqgrad.data's dependencies, only on request.
data = ['transformers>=5.23,<6; extra == "data"', 'jinja2>=3.1; extra == "data"', 'datasets>=5.2; extra == "data"']
assert importlib.metadata.requires("seqgrad") == ["numpy>=1.24,<3"] + data, importlib.metadata.requires("seqgrad")
assert importlib.metadata.metadata("seqgrad").get_all("Provides-Extra") == ["data"]
minor = sys.version_info[1]
assert importlib.metadata.metadata("seqgrad")["Requires-Python"] == ">=3.%d,<3.%d" % (minor, minor + 1)
package = os.path.dirname(seqgrad.__file__)
assert package.startswith(sys.prefix), package
bundled = os.path.join(os.path.dirname(package), "seqgrad.libs")
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
copies = [os.path.join(bundled, f) for f in os.listdir(bundled)]
# The module loads the bundle's libraries (the command-line tools need more of them: Abseil's flags).
assert [p for p in copies if os.path.basename(p).startswith("libopenblas")][0] in maps, copies
assert [p for p in maps if p.startswith(os.path.join(package, "libseqgrad.so"))], maps
numpy_dir = os.path.dirname(np.__path__[0])  # NumPy 2 brings its own OpenBLAS and libgfortran
bundled_kinds = ("libseqgrad", "libabsl_", "libopenblas", "libgomp", "libgfortran", "libquadmath")
for p in maps:
    if os.path.basename(p).startswith(bundled_kinds):
        assert p.startswith(sys.prefix) or p.startswith(numpy_dir), p

with seqgrad.Model.from_preset("tiny") as model, seqgrad.Trainer(model) as trainer:
    w = model.parameters()["model.embed_tokens.weight"]
    assert w.strides == (4 * w.shape[1], 4), w.strides
    before = w.copy()
    loss = trainer.step([[1, 2, 3, 4, 5, 6]])["loss"]
    assert np.isfinite(loss) and not np.array_equal(before, w)
# fit(strategy="auto") plans with the wheel's own plan tool: a budget under full's peak picks another strategy.
records = [{"input_ids": [(i * 7 + k) % 90 for i in range(64)]} for k in range(4)]
result = seqgrad.fit("tiny", records, max_steps=2, per_device_train_batch_size=2, memory_budget=10 ** 12,
                     progress=False)
assert result.strategy == "full", result.strategy_reason
tight = seqgrad.fit("tiny", records, max_steps=1, per_device_train_batch_size=2,
                    memory_budget=result.planned_peak_bytes - 1, progress=False)
assert tight.strategy != "full", tight.strategy_reason
print("seqgrad", seqgrad.version(), "numpy", np.__version__, "loss", loss, "libraries from", bundled)
print("fit(strategy='auto') from the wheel:", tight.strategy_reason)
PY
cd /  # import the installed package, not the source tree
"$hide" "$tmp/venv/bin/python" "$tmp/check.py"

# Tensor parallelism from the installed wheel: its libseqgrad_mpi.so with the system's OpenMPI, under mpirun -np 2.
cat >"$tmp/tp_check.py" <<'PY'
import seqgrad
batch = [[(i * 37 + 11) % 128 for i in range(40)]]
with seqgrad.Model.from_preset("demo", dtype="f64", seed=3) as a, seqgrad.Model.from_preset("demo", dtype="f64", seed=3) as b:
    one, tp = seqgrad.Trainer(a, strategy="seco", chunk=16, page_size=8), seqgrad.Trainer(b, strategy="seco", chunk=16, page_size=8, tp=2)
    x, y = one.step(batch), tp.step(batch)
    assert y["tp"] == 2 and abs(x["loss"] - y["loss"]) <= 1e-12 * x["loss"], (x["loss"], y["loss"])
print("tp=2 from the wheel: loss", y["loss"], "one process", x["loss"])
PY
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"  # a private OpenMPI session directory (distributed/mpi_run_test.sh)
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
timeout --signal=KILL 120 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader -np 2 \
  "$hide" "$tmp/venv/bin/python" "$tmp/tp_check.py"

# The console script: the package's tools are the Bazel-built programs (same flags, same output).
cd "$tmp"
plan_args=(--model=tiny --seq_len=4096 --strategy=seco --json)
"$hide" "$tmp/venv/bin/seqgrad" plan "${plan_args[@]}" >"$tmp/plan_wheel.json"
"$plan" "${plan_args[@]}" >"$tmp/plan_bazel.json"
cmp "$tmp/plan_wheel.json" "$tmp/plan_bazel.json" || { echo "FAIL: seqgrad plan differs from //cli:plan" >&2; exit 1; }
train_args=(--model=tiny --steps=3 --seq_len=600 --threads=1 --report=report.json)
"$hide" "$tmp/venv/bin/seqgrad" train "${train_args[@]}" >"$tmp/train_wheel.txt"
mv report.json report_wheel.json
"$train" "${train_args[@]}" >"$tmp/train_bazel.txt"
losses() { "$tmp/venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["losses"])' "$1"; }
[[ "$(losses report_wheel.json)" == "$(losses report.json)" ]] ||
  { echo "FAIL: seqgrad train's losses differ from //cli:train's" >&2; exit 1; }
grep -q "^done: 3 steps" "$tmp/train_wheel.txt" || { echo "FAIL: seqgrad train printed no summary" >&2; exit 1; }
"$tmp/venv/bin/seqgrad" data --help | grep -q -- "--tokenizer" || { echo "FAIL: seqgrad data --help" >&2; exit 1; }
if "$tmp/venv/bin/seqgrad" nosuchtool 2>"$tmp/err.txt"; then echo "FAIL: an unknown tool ran" >&2; exit 1; fi
grep -q "unknown tool 'nosuchtool'" "$tmp/err.txt" || { echo "FAIL: $(cat "$tmp/err.txt")" >&2; exit 1; }
# The tools join an mpirun job through the wheel's MPI plug-in: data parallel over 2 ranks.
timeout --signal=KILL 120 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader -np 2 \
  "$hide" "$tmp/venv/bin/seqgrad" train --dist=mpi --model=tiny --steps=1 --seq_len=600 --threads=1 >"$tmp/dp.txt"
grep -q "^done: 1 steps" "$tmp/dp.txt" || { echo "FAIL: seqgrad train --dist=mpi: $(cat "$tmp/dp.txt")" >&2; exit 1; }
echo "console script: plan and train match the Bazel-built tools; train --dist=mpi runs from the wheel"
