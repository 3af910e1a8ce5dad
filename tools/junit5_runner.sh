#!/usr/bin/env bash
# Runs JUnit 5 tests for junit5_test (//tools:javac.bzl) inside a Bazel sh_test.
# usage: junit5_runner.sh <java> <junit-platform-console-standalone.jar> \
#            [--jvm_flag=FLAG]... -- <jar>...
set -euo pipefail

java="$1"
console="$2"
shift 2
jvm_flags=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
  jvm_flags+=("${1#--jvm_flag=}")
  shift
done
[[ $# -gt 0 ]] && shift  # the "--"
classpath="$(IFS=:; echo "$*")"

reports="${TEST_UNDECLARED_OUTPUTS_DIR:-${TEST_TMPDIR:-/tmp}}/junit-reports"
# Temporary files (e.g. native libraries extracted from jars) stay in the test's own directory.
[[ -n "${TEST_TMPDIR:-}" ]] && jvm_flags=("-Djava.io.tmpdir=$TEST_TMPDIR" "${jvm_flags[@]}")
mkdir -p "$reports"

exec "$java" "${jvm_flags[@]}" -jar "$console" \
  --disable-banner \
  --disable-ansi-colors \
  --details=tree \
  --fail-if-no-tests \
  --reports-dir="$reports" \
  --class-path "$classpath" \
  --scan-class-path
