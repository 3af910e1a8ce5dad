#!/bin/bash
# Prints the directory of a venv with torch, transformers and peft from PyPI (the releases the tests are pinned to),
# or with the pins given as arguments, making it first if needed.
# usage: pip_venv.sh [PIN...] Kept under ~/.cache/seqgrad-pip (Bazel sets HOME to the test's tmpdir: the real home
# comes from the password database), built once per set of pins; torch's wheels are taken from
# ~/.cache/seqgrad-pip/wheels when they are there. Where that directory is not writable: in the test's tmpdir.
# Tests that use it are tagged no-sandbox (the sandbox makes the cache read-only) and requires-network (first run).
set -euo pipefail
PINS=(torch==2.15.0 transformers==5.23.0 tokenizers==0.23.3 jinja2==3.1.6 peft==0.21.2 accelerate==1.15.0)
if (( $# )); then PINS=("$@"); fi
cache="$(getent passwd "$(id -u)" | cut -d: -f6)/.cache/seqgrad-pip"
mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || cache="$TEST_TMPDIR"
key="$( (/usr/bin/python3 --version; echo "${PINS[@]}") | sha256sum | cut -c1-12)"
venv="$cache/e2e-venv-$key"
if [ ! -e "$venv/complete" ]; then
  build="$(mktemp -d "$cache/e2e-venv-build.XXXXXX")"  # then renamed: concurrent runs are safe
  trap 'rm -rf "$build"' EXIT  # a failed install leaves nothing behind
  /usr/bin/python3 -m venv "$build"
  "$build/bin/pip" install --quiet --disable-pip-version-check --cache-dir "$cache/cache" \
      --find-links "$cache/wheels" "${PINS[@]}" >&2
  touch "$build/complete"
  mv -T "$build" "$venv" 2>/dev/null || rm -rf "$build"  # another run finished first: use its venv
fi
echo "$venv"
