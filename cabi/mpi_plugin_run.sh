#!/bin/bash
# mpi_plugin_run.sh PLUGIN MPI_RUN_TEST NP PROGRAM...: runs distributed/mpi_run_test.sh with SEQGRAD_MPI_PLUGIN naming
# libseqgrad_mpi.so, which a Bazel test's libseqgrad.so (in _solib) cannot find beside itself.
set -euo pipefail
export SEQGRAD_MPI_PLUGIN="$(readlink -f "$1")"
runner="$2"
shift 2
exec "$runner" "$@"
