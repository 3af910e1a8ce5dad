#!/bin/bash
# libseqgrad.so must export exactly the symbols listed in cabi/exported_symbols.txt: an ABI change is deliberate.
# To update after adding a function: nm -D --defined-only bazel-bin/cabi/libseqgrad.so | awk '{print $3}' |
#   sed 's/@.*//' | sort > cabi/exported_symbols.txt
set -euo pipefail
lib="$1"
want="$2"
got="$(nm -D --defined-only "$lib" | awk 'NF == 3 {print $3}' | sed 's/@.*//' | grep -v '^SEQGRAD_' | sort)"
if ! diff -u "$want" <(echo "$got"); then
  echo "FAIL: exported symbols of $lib differ from $want (lines with + are new exports)" >&2
  exit 1
fi
bad="$(echo "$got" | grep -v '^sg_' || true)"
if [ -n "$bad" ]; then
  echo "FAIL: non-sg_ symbols exported: $bad" >&2
  exit 1
fi
echo "OK: $(echo "$got" | wc -l) sg_* symbols"
