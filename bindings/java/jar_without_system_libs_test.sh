#!/usr/bin/env bash
# The jar runs with only a JRE: the Debian libraries the engine was built against beyond glibc and the C++ runtime
# (Abseil, OpenBLAS, libgomp, libgfortran, libquadmath) are hidden from the loader (tools/hide_system_libs.sh). Shown: the libraries without their bundled dependencies (-Dseqgrad.library.path)
# then fail to load, while the jar trains a step and /proc/self/maps shows its own copies (JarSmoke).
# usage: jar_without_system_libs_test.sh JAVA SEQGRAD_JAR SMOKE_JAR UNBUNDLED_JNI_LIB VERSION HIDE_SYSTEM_LIBS
set -euo pipefail
java="$(readlink -f "$1")"; jar="$(readlink -f "$2")"; smoke="$(readlink -f "$3")"
unbundled="$(dirname "$(readlink -f "$4")")"; version="$5"; hide="$(readlink -f "$6")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"

if [[ "${SG_LIBS_HIDDEN:-}" != 1 ]]; then
  [[ "$(basename "$jar")" == "seqgrad-$version.jar" ]] || { echo "jar name $(basename "$jar") lacks $version"; exit 1; }
  exec "$hide" "$0" "$@"
fi
libdir=/usr/lib/x86_64-linux-gnu
for f in "$libdir/libgomp.so.1" "$libdir/libabsl_base.so.20220623" "$libdir/openblas-openmp/libopenblas.so.0"; do
  [[ ! -s "$f" ]] || { echo "$f is still readable"; exit 1; }
done

# Control: the unbundled libraries need the hidden ones, so loading them must fail.
if out="$("$java" -Dseqgrad.library.path="$unbundled" -cp "$jar:$smoke" org.seqgrad.JarSmoke "$version" 2>&1)"; then
  echo "$out"
  echo "the unbundled libraries loaded although their dependencies are hidden"
  exit 1
fi
grep -q UnsatisfiedLinkError <<<"$out" || { echo "$out"; echo "expected an UnsatisfiedLinkError"; exit 1; }
echo "control: unbundled libraries fail to load: $(grep -m1 -o 'UnsatisfiedLinkError.*' <<<"$out")"

"$java" -Djava.io.tmpdir="$tmp" -cp "$jar:$smoke" org.seqgrad.JarSmoke "$version"

# Outside the JVM too, the loader resolves every dependency but glibc's and the C++ runtime beside the JNI library.
(cd "$tmp" && "$(dirname "$java")/jar" xf "$jar" org/seqgrad/native)
native="$tmp/org/seqgrad/native/linux-x86_64"
deps="$(ldd "$native/libseqgrad_jni.so")"
system='^(linux-vdso|ld-linux-x86-64|libc|libm|libmvec|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s)\.so'
outside="$(awk '$2 == "=>" { print $1, $3 }' <<<"$deps" | grep -Ev "$system" | grep -v " $native/" || true)"
[[ -z "$outside" ]] || { echo "$deps"; echo "resolved outside the bundle: $outside"; exit 1; }
echo "OK: ldd resolves all $(grep -c " => $native/" <<<"$deps") bundled dependencies inside the bundle"
