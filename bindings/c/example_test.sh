#!/bin/bash
# Runs the C example for a few steps and checks that it trained.
set -euo pipefail
out="$("$1" 4)"
echo "$out"
grep -q "^step 4 loss" <<<"$out"
