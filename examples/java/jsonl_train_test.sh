#!/bin/bash
# Runs the JSONL pipeline for 2 epochs and checks that it printed losses and that the loss went down.
# usage: jsonl_train_test.sh JAVA EXAMPLE_JAR SEQGRAD_JAR JSONL NATIVE_LIB
set -euo pipefail
java="$1"; example="$2"; seqgrad="$3"; data="$4"; native_dir="$(dirname "$(readlink -f "$5")")"
# Native libraries from the override directory (-Dseqgrad.library.path), not from the jar.
out="$("$java" -Dseqgrad.library.path="$native_dir" -cp "$example:$seqgrad" org.seqgrad.examples.JsonlTrain \
  "$data" 2 4)"
echo "$out"
test "$(grep -c '^epoch .* loss ' <<<"$out")" -eq 4
first="$(grep '^epoch' <<<"$out" | head -1 | awk '{print $6}')"
last="$(grep '^epoch' <<<"$out" | tail -1 | awk '{print $6}')"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "loss did not go down: $first -> $last"; exit 1; }
