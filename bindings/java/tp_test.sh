#!/bin/bash
# Trainer.Options.tp(2) from the jar alone under mpirun -np 2 (distributed/mpi_run_test.sh runs a JVM per rank).
# usage: tp_test.sh JAVA SEQGRAD_JAR MAIN_JAR MPI_RUN_TEST
set -euo pipefail
java="$(readlink -f "$1")"; jar="$(readlink -f "$2")"; main="$(readlink -f "$3")"
export JAVA_TOOL_OPTIONS="-Djava.io.tmpdir=${TEST_TMPDIR:-/tmp} -Xmx256m"
exec "$4" 2 "$java" -cp "$jar:$main" org.seqgrad.TensorParallelMain
