#!/bin/bash
# The layering of docs/design.md ("Layers of the code"), checked on the #include lines of the sources:
#   base/     includes nothing of core/, kernels/, distributed/ or cabi/;
#   kernels/  includes nothing of core/ or distributed/;
#   core/     includes nothing of distributed/ or cabi/.
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

# An empty runfiles tree would pass: the three layers hold well over 100 sources.
if ((checked < 100)); then
  echo "FAIL only ${checked} sources found under base/, kernels/ and core/ in the runfiles"
  status=1
fi
((status)) || echo "layering: ${checked} sources of base/, kernels/ and core/ follow the rule"
exit "$status"
