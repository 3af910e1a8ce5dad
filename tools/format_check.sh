#!/usr/bin/env bash
# Holds the C++ and CUDA sources to .clang-format (clang-format 14, Debian 12's; other versions wrap differently).
# Files in tools/format_exempt.txt predate the check: each is checked from the change that reformats it and drops it
# from the list, and a listed file that is already clean fails the check, so the list only shrinks.
# usage: tools/format_check.sh [--fix]   (--fix reformats the files the check covers, in place)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fix=0
case "${1:-}" in
  "") ;;
  --fix) fix=1 ;;
  *) echo "format_check.sh: unknown argument '$1' (--fix)" >&2; exit 2 ;;
esac
cf="$(command -v clang-format-14 || true)"
if [[ -z "$cf" ]] && command -v clang-format >/dev/null && clang-format --version | grep -q "version 14\."; then
  cf="$(command -v clang-format)"
fi
if [[ -z "$cf" ]]; then
  echo "format_check.sh: clang-format 14 not found (Debian 12: apt install clang-format)" >&2
  exit 2
fi

declare -A exempt=()
while IFS= read -r f; do
  [[ -z "$f" || "$f" == \#* ]] || exempt["$f"]=1
done <tools/format_exempt.txt

unformatted=() clean_but_listed=()
while IFS= read -r f; do
  if "$cf" --dry-run --Werror --style=file "$f" >/dev/null 2>&1; then
    [[ -n "${exempt[$f]:-}" ]] && clean_but_listed+=("$f")
  elif [[ -z "${exempt[$f]:-}" ]]; then
    if ((fix)); then "$cf" -i --style=file "$f"; else unformatted+=("$f"); fi
  fi
done < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' ':!third_party')

status=0
if ((${#unformatted[@]})); then
  echo "format_check.sh: not formatted by .clang-format (tools/format_check.sh --fix formats them):" >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  status=1
fi
if ((${#clean_but_listed[@]})); then
  echo "format_check.sh: formatted, so drop them from tools/format_exempt.txt:" >&2
  printf '  %s\n' "${clean_but_listed[@]}" >&2
  status=1
fi
sources="$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' ':!third_party' | wc -l)"
((status)) || echo "format_check.sh: $sources sources, ${#exempt[@]} exempt, the rest formatted"
exit "$status"
