#!/usr/bin/env bash
# Runs the tiny MPI program on 2 ranks. usage: mpi_test.sh <mpi_hello binary>
set -euo pipefail
# Open MPI's dlopen'ed components leak by design; keep LeakSanitizer (--config=asan) quiet
# about them (children of mpirun inherit the environment).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
out="$(mpirun --allow-run-as-root --oversubscribe -np 2 "$1" 2>&1)" || {
  echo "$out"
  exit 1
}
echo "$out"
grep -q "mpi_hello: size=2 total=3 OK" <<<"$out"
