#!/bin/bash
# Runs the C example for a few steps (seco, then spaco) and checks that it trained.
set -euo pipefail
out="$("$1" 4)"
echo "$out"
grep -q "^step 4 loss.* tokens 48 .* chunks 4/4 " <<<"$out"
grep -Eq "^response log-prob -[0-9.]+ over 48 tokens" <<<"$out"
out="$("$1" 3 spaco)"
echo "$out"
grep -Eq "^step 3 loss.* chunks [0-4]/4 " <<<"$out"
