#!/bin/bash
# Installs the wheel into a fresh venv (offline, no deps: numpy from the system) and trains a step with it.
set -euo pipefail
whl="$(readlink -f "$1")"
venv="${TEST_TMPDIR:-$(mktemp -d)}/venv"
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$whl"
cd /  # import from the venv, not from the source tree
"$venv/bin/python" - <<'PY'
import seqgrad
assert "site-packages" in seqgrad.__file__, seqgrad.__file__
with seqgrad.Model.from_preset("tiny") as m, seqgrad.Trainer(m) as t:
    r = t.step([[1, 2, 3, 4, 5, 6]])
print("seqgrad", seqgrad.version(), "from", seqgrad.__file__, "loss", r["loss"])
PY
