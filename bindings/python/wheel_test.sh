#!/bin/bash
# The wheel is self-contained: a manylinux tag, no RUNPATH into Bazel's tree or /usr, and it installs into a fresh
# venv without system site packages (NumPy 2 from PyPI) and trains with Debian's copies of the libraries it bundles
# hidden from the loader (tools/hide_system_libs.sh), also with tp=2 under mpirun -np 2 (the system's OpenMPI).
# usage: wheel_test.sh WHEEL NUMPY2_DIR HIDE_SYSTEM_LIBS (NUMPY2_DIR: PyPI's NumPy 2, pip-installed by ./bazelw)
set -euo pipefail
whl="$(readlink -f "$1")"
numpy2="$2"
hide="$(readlink -f "$3")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

if [[ "$(basename "$whl")" != seqgrad-*-cp311-cp311-manylinux_*_x86_64.whl ]]; then
  echo "FAIL: $(basename "$whl") has no manylinux platform tag" >&2
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

/usr/bin/python3 -m venv "$tmp/venv"  # no system site packages: Debian's NumPy, torch, ... are not there
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
package = os.path.dirname(seqgrad.__file__)
assert package.startswith(sys.prefix), package
bundled = os.path.join(os.path.dirname(package), "seqgrad.libs")
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
copies = [os.path.join(bundled, f) for f in os.listdir(bundled)]
assert copies and not [p for p in copies if p not in maps], (copies, maps)  # every bundled library is loaded
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
print("seqgrad", seqgrad.version(), "numpy", np.__version__, "loss", loss, "libraries from", bundled)
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
