// host_staged_nccl.h in builds without --config=cuda: --dist=nccl is refused with a clear error.
#include "distributed/host_staged_nccl.h"

namespace sg::dist {

absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedNcclCommunicator() {
  return absl::FailedPreconditionError(
      "NCCL is not available: this binary was built without --config=cuda (rebuild with "
      "`./bazelw build --config=cuda //cli:train`, or use --dist=mpi, which works in every build)");
}

bool HostStagedNcclBuilt() { return false; }

}  // namespace sg::dist
