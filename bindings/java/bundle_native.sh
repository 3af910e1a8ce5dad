#!/usr/bin/env bash
# Makes the jar's native directory self-contained: copies LIBs (named by their SONAME) and every library they load
# (ldd: the transitive closure) except glibc's and the C++ runtime into OUT_DIR, sets each one's RUNPATH to $ORIGIN
# (so the loader finds their dependencies beside them and nowhere else) and lists them in OUT_DIR/libs.txt for the
# Java loader. libstdc++ and libgcc_s stay the system's (manylinux's policy): a JVM that links them has loaded its
# own already, and Debian 12's copies would need glibc 2.36 (arc4random) where the rest needs 2.34.
# usage: bundle_native.sh OUT_DIR LIB...
set -euo pipefail
out="$1"
shift
mkdir -p "$out"
command -v patchelf >/dev/null || { echo "bundle_native.sh: patchelf not found (apt-get install patchelf)" >&2; exit 1; }

system='^(linux-vdso|ld-linux-x86-64|libc|libm|libmvec|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s)\.so'
for lib in "$@"; do
  soname="$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')"
  cp -L "$lib" "$out/${soname:-$(basename "$lib")}"
done
# The copies' DT_NEEDED resolve among themselves first (the JNI library finds libseqgrad.so by $ORIGIN).
ldd "$out"/* | awk '$2 == "=>" { print $1, $3 }' | sort -u | while read -r name path; do
  [[ "$name" =~ $system ]] && continue
  [[ "$path" == "not" ]] && { echo "bundle_native.sh: $name not found" >&2; exit 1; }
  [[ -e "$out/$name" ]] || cp -L "$path" "$out/$name"
done
chmod u+w "$out"/*
for f in "$out"/*; do
  patchelf --set-rpath '$ORIGIN' "$f"
done
libs="$(cd "$out" && ls)"
echo "$libs" > "$out/libs.txt"
