#!/bin/bash
# The layering of docs/design.md ("Layers of the code"), checked on the #include lines of the sources:
#   base/     includes nothing of core/, kernels/, distributed/ or cabi/;
#   kernels/  includes nothing of core/ or distributed/;
#   core/     includes nothing of distributed/ or cabi/;
#   the strategies (core/strategies/, core/strategy.{h,cc}) include nothing of core/models/: they see a model only
#   through core/model.h (Bazel visibility keeps //core/strategies off the families' targets as well).
# One exemption: a kernels test (kernels/**/*_test.cc) may include core/, since bf16_strategy_test runs the engine's
# strategies on the CUDA backend. A test is a leaf (nothing links it), so this makes no kernels library depend on core.
# The sources come from each package's :sources filegroup (layer_sources() of tools/layers.bzl; this test's data, in
# the runfiles): a new package under base/, kernels/ or core/ calls it and adds its :sources to the data in tools/BUILD.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"

status=0
checked=0
# check <layer dir> <pattern of forbidden include paths> <what the rule says>
check() {
  local dir="$1" forbidden="$2" rule="$3" file line
  while IFS= read -r file; do
    checked=$((checked + 1))
    while IFS= read -r line; do
      if [[ "$dir" == kernels && "$file" == *_test.cc && "$line" =~ \"core/ ]]; then continue; fi
      echo "FAIL ${file}: ${line#*:}  (${rule})"
      status=1
    done < <(grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[\"<](${forbidden})/" "$file" || true)
  done < <(find -L "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) |
    sort)
}

check base "core|kernels|distributed|cabi" "base/ includes nothing above it"
check kernels "core|distributed" "kernels/ includes nothing of core/ or distributed/"
check core "distributed|cabi" "core/ includes nothing of distributed/ or cabi/"
layers=$checked
for path in core/strategies core/strategy.h core/strategy.cc; do
  check "$path" "core/models" "the strategies include no model family: core/model.h is their interface"
done
strategies=$((checked - layers))

# An empty runfiles tree would pass: the three layers hold well over 100 sources, the strategies 10.
if ((layers < 100)); then
  echo "FAIL only ${layers} sources found under base/, kernels/ and core/ in the runfiles"
  status=1
fi
if ((strategies < 10)); then
  echo "FAIL only ${strategies} sources of the strategies found in the runfiles"
  status=1
fi
((status)) || echo "layering: ${layers} sources of base/, kernels/, core/ follow the rules (strategies: ${strategies})"
exit "$status"
