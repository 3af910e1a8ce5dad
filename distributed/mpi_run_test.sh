#!/bin/bash
# Runs an MPI test program on NP ranks on this machine: mpirun_test.sh NP PROGRAM [ARGS...].
# OpenMPI as root needs --allow-run-as-root; --oversubscribe lets 2 ranks run on fewer cores; shared memory (vader)
# plus self suffices on one host, and single-copy (CMA) is often denied in containers.
set -euo pipefail
np="$1"; shift
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec timeout --signal=KILL 300 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader \
  -np "$np" "$@"
