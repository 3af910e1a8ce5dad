// The NCCL backend of Communicator (GPUs; compiled only under --config=cuda). Every buffer is DEVICE memory on the
// communicator's device. Ranks find each other through a bootstrap Communicator (normally the MPI one): rank 0
// creates the NCCL unique id and broadcasts it; with no bootstrap the communicator is a single process (size 1).
//
// Each operation is enqueued on the communicator's own CUDA stream and then polled (cudaStreamQuery plus
// ncclCommGetAsyncError) until it completes or timeout_s passes: then the NCCL communicator is aborted
// (ncclCommAbort, which frees the ranks stuck with it), the call returns DEADLINE_EXCEEDED and the communicator is
// broken (every later call fails; see communicator.h). Operations are synchronous: they return when the data is in
// place. Recv cannot check the sender's element count (NCCL does not report it): both sides must agree.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "base/communicator.h"

namespace sg::dist {

struct NcclOptions {
  int device = -1;         // CUDA device; -1: the bootstrap rank modulo the number of visible devices
  double timeout_s = 300;  // <= 0 waits forever; SEQGRAD_DIST_TIMEOUT_S overrides it
};

// bootstrap: the ranks and the channel for the unique id (it must outlive this call only); null: one process.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator* bootstrap,
                                                                     const NcclOptions& options = {});

}  // namespace sg::dist
