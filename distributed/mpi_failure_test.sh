#!/bin/bash
# A stuck peer and a dead peer end a 2-rank job with a clear error within seconds (no hang).
set -uo pipefail
run="$1"; prog="$2"
check() {  # mode, expected text, seconds allowed
  local start=$(date +%s) out rc
  out=$(SEQGRAD_DIST_TIMEOUT_S=2 "$run" 2 "$prog" "$1" 2>&1); rc=$?
  local took=$(( $(date +%s) - start ))
  echo "--- $1: exit $rc after ${took}s"; echo "$out" | tail -n 15
  if [[ $rc -eq 0 ]]; then echo "FAIL: $1: the job succeeded"; exit 1; fi
  if (( took > $3 )); then echo "FAIL: $1: took ${took}s > $3s"; exit 1; fi
  if ! grep -q "$2" <<<"$out"; then echo "FAIL: $1: no '$2' in the output"; exit 1; fi
}
check stuck "all_reduce did not complete within 2 s" 60
check die "rank 1: dying mid-step" 60
echo PASS
