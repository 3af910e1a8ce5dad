// --dist=nccl for engines whose gradients and weights live in host memory (the CPU backend): a Communicator over
// the NCCL backend (nccl_communicator.h) that copies each host buffer into a device staging buffer (cudaMalloc'd
// once, grown as needed), runs the NCCL collective there and copies the result back, synchronising its stream, so
// every buffer handed to it is HOST memory; device_memory() is the NCCL communicator itself, for device buffers
// (tensor parallelism's activations on the GPU). No CUDA or NCCL header is included here: in builds without
// --config=cuda the factory is compiled from host_staged_nccl_nocuda.cc and only returns an error.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "base/communicator.h"

namespace sg::dist {

// Joins the mpirun job (the MPI communicator, owned by the result, broadcasts rank 0's NCCL unique id), selects one
// GPU per rank (cudaSetDevice(OMPI_COMM_WORLD_LOCAL_RANK), 0 when unset) and returns the host-staged NCCL
// communicator. Without --config=cuda: FAILED_PRECONDITION saying so (nothing is initialised).
absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedNcclCommunicator();

// Whether this binary was built with --config=cuda (NCCL available).
bool HostStagedNcclBuilt();

}  // namespace sg::dist
