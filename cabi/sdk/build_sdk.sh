#!/bin/bash
# Lays out the C SDK and packs it: include/seqgrad/*.h, lib/libseqgrad.so.X.Y (+ libseqgrad.so link and the bundled
# libraries it loads, each with RUNPATH $ORIGIN), lib/pkgconfig/seqgrad.pc, lib/cmake/seqgrad/*.cmake,
# share/seqgrad/example.c; lib/libseqgrad_mpi.so (tensor parallelism: libseqgrad.so loads it only for tp > 1; it
# links the system's OpenMPI, which is not bundled: a job uses the OpenMPI of its own mpirun).
# usage: build_sdk.sh OUT.tar.gz VERSION SONAME BUNDLER LIBSEQGRAD MPI_PLUGIN PATCHELF EXAMPLE_C TEMPLATE_DIR HEADER...
set -euo pipefail
out="$1" version="$2" soname="$3" bundler="$4" lib="$5" mpi_plugin="$6" patchelf="$7" example="$8" templates="$9"
shift 9
name="$(basename "$out" .tar.gz)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
root="$stage/$name"
mkdir -p "$root/include/seqgrad" "$root/lib/pkgconfig" "$root/lib/cmake/seqgrad" "$root/share/seqgrad"
cp "$@" "$root/include/seqgrad/"
/usr/bin/python3 "$bundler" "$root/lib" "$lib" >/dev/null
ln -s "$soname" "$root/lib/libseqgrad.so"
cp "$mpi_plugin" "$root/lib/libseqgrad_mpi.so"
chmod u+w "$root/lib/libseqgrad_mpi.so"
"$patchelf" --set-rpath '$ORIGIN' "$root/lib/libseqgrad_mpi.so"  # the bundled Abseil
major="${version%%.*}" rest="${version#*.}" minor="${rest%%.*}"
fill() { sed -e "s/@VERSION@/$version/g" -e "s/@SONAME@/$soname/g" -e "s/@MAJOR@/$major/g" -e "s/@MINOR@/$minor/g" "$1"; }
fill "$templates/seqgrad.pc.in" >"$root/lib/pkgconfig/seqgrad.pc"
fill "$templates/seqgradConfig.cmake.in" >"$root/lib/cmake/seqgrad/seqgradConfig.cmake"
fill "$templates/seqgradConfigVersion.cmake.in" >"$root/lib/cmake/seqgrad/seqgradConfigVersion.cmake"
cp "$example" "$root/share/seqgrad/example.c"
chmod -R u+w,go-w "$root"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$stage" -czf "$out" "$name"
