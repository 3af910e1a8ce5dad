#!/bin/bash
# Runs an MPI test program on NP ranks on this machine: mpirun_test.sh NP PROGRAM [ARGS...].
# OpenMPI as root needs --allow-run-as-root; --oversubscribe lets 2 ranks run on fewer cores; shared memory (vader)
# plus self suffices on one host, and single-copy (CMA) is often denied in containers.
set -euo pipefail
np="$1"; shift
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bazel runs tests in parallel sandboxes with their own PID namespaces but a shared /tmp and /dev/shm: two mpiruns
# with the same PID would share OpenMPI's session directory and shared-memory segments (mkdir errors, segfaults in
# vader). A private directory per run keeps them apart.
mpi_dir="$(mktemp -d /tmp/sg-mpi.XXXXXX)"
trap 'rm -rf "$mpi_dir"' EXIT
export OMPI_MCA_orte_tmpdir_base="$mpi_dir" OMPI_MCA_btl_vader_backing_directory="$mpi_dir"
timeout --signal=KILL 300 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader \
  -np "$np" "$@"
