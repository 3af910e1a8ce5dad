// The MPI backend of Communicator (Debian OpenMPI). Launch with mpirun; a process started without it is a
// singleton job of size 1.
//
// MPI is initialised on first use (MPI_Init_thread, MPI_THREAD_FUNNELED: one thread per rank talks to MPI) and
// finalised at process exit. The communicator works on a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so an
// MPI error becomes a status (with MPI's own message) instead of killing the job. Every operation is posted
// non-blocking (MPI_Iallreduce, ...) and polled with MPI_Test until it completes or timeout_s passes:
// then DEADLINE_EXCEEDED, and the communicator is broken (see communicator.h); exiting with a broken communicator
// skips MPI_Finalize (which could wait for the dead peer) and mpirun reports the job as failed.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "base/communicator.h"

namespace sg::dist {

struct MpiOptions {
  // Seconds an operation may take before it fails with DEADLINE_EXCEEDED; <= 0 waits forever. The environment
  // variable SEQGRAD_DIST_TIMEOUT_S, when set, overrides it.
  double timeout_s = 300;
};

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiOptions& options = {});

}  // namespace sg::dist
