#!/bin/bash
# Installs the C SDK tarball into a temporary prefix, builds the C example against it with pkg-config and with
# CMake's find_package, and runs both with the build machine's Abseil/OpenBLAS/OpenMP libraries hidden.
# usage: sdk_test.sh SDK.tar.gz HIDE_SYSTEM_LIBS VERSION SONAME
set -euo pipefail
sdk="$(readlink -f "$1")" hide="$(readlink -f "$2")" version="$3" soname="$4"
work="${TEST_TMPDIR:-$(mktemp -d)}/sdk_test"
rm -rf "$work" && mkdir -p "$work/prefix"
tar -xzf "$sdk" -C "$work/prefix" --strip-components=1
prefix="$work/prefix"
fail() { echo "FAIL: $*" >&2; exit 1; }

# The library: versioned SONAME; it and every bundled library find their dependencies beside themselves only.
readelf -d "$prefix/lib/$soname" | grep -q "Library soname: \[$soname\]" || fail "SONAME of $soname"
for f in "$prefix"/lib/*.so*; do
  [[ -L "$f" ]] && continue
  runpath="$(readelf -d "$f" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
  [[ "$runpath" == '$ORIGIN' ]] || fail "$(basename "$f") has RUNPATH '$runpath', want \$ORIGIN"
done
ls "$prefix/lib" | grep -q '^libopenblas' || fail "OpenBLAS is not bundled"

# pkg-config.
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
[[ "$(pkg-config --modversion seqgrad)" == "$version" ]] || fail "pkg-config --modversion"
cc -std=c99 -Wall -Werror -o "$work/example_pc" "$prefix/share/seqgrad/example.c" $(pkg-config --cflags --libs seqgrad)

# CMake: a compatible version is found, another minor version is not.
cmake_project() {  # DIR VERSION_REQUESTED
  mkdir -p "$1"
  cat >"$1/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(seqgrad_sdk_example C)
find_package(seqgrad $2 REQUIRED)
add_executable(example "$prefix/share/seqgrad/example.c")
target_link_libraries(example PRIVATE seqgrad::seqgrad)
CMAKE
  cmake -S "$1" -B "$1/build" -DCMAKE_PREFIX_PATH="$prefix" >"$1/cmake.log" 2>&1 && cmake --build "$1/build" >>"$1/cmake.log" 2>&1
}
major="${version%%.*}" rest="${version#*.}" minor="${rest%%.*}"
cmake_project "$work/cmake" "$major.$minor" || { cat "$work/cmake/cmake.log"; fail "cmake with find_package($major.$minor)"; }
if cmake_project "$work/cmake_other" "$major.$((minor + 1))"; then
  fail "find_package(seqgrad $major.$((minor + 1))) accepted $version"
fi

# Both programs train with the system's copies of the bundled libraries hidden.
for exe in "$work/example_pc" "$work/cmake/build/example"; do
  out="$("$hide" "$exe" 3)"
  echo "$out"
  grep -q "^step 3 loss.* chunks 4/4 " <<<"$out" || fail "$exe did not train"
  deps="$("$hide" ldd "$exe")"
  if grep -E 'libopenblas|libabsl|libgomp' <<<"$deps" | grep -v "$prefix/lib/"; then
    fail "$exe loads the libraries above from outside the SDK"
  fi
done
# libseqgrad_mpi.so (tensor parallelism): the bundled Abseil, the system's OpenMPI.
deps="$("$hide" ldd "$prefix/lib/libseqgrad_mpi.so")"
if grep -E 'not found' <<<"$deps" || grep 'libabsl' <<<"$deps" | grep -v "$prefix/lib/"; then
  fail "libseqgrad_mpi.so does not find its libraries"
fi
grep -q 'libmpi.so.40 => /' <<<"$deps" || fail "libseqgrad_mpi.so does not load the system's libmpi.so.40"
echo "sdk_test: OK ($version, $soname)"
