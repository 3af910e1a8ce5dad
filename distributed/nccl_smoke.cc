// One-process NCCL check for a GPU machine (--config=cuda): all-reduce, broadcast, all-gather, reduce-scatter and
// barrier on device buffers of a size-1 communicator. Prints "nccl smoke: OK" or the first failure.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "distributed/nccl_communicator.h"

int main() {
  absl::StatusOr<std::unique_ptr<sg::dist::Communicator>> comm = sg::dist::CreateNcclCommunicator(nullptr);
  if (!comm.ok()) {
    std::fprintf(stderr, "nccl smoke: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  std::vector<float> host = {1.5f, -2.0f, 3.0f, 4.0f}, back(4);
  float *d = nullptr, *e = nullptr;
  cudaMalloc(&d, 4 * sizeof(float));
  cudaMalloc(&e, 4 * sizeof(float));
  cudaMemcpy(d, host.data(), 4 * sizeof(float), cudaMemcpyHostToDevice);
  sg::dist::Communicator& c = **comm;
  for (absl::Status s : {c.AllReduce(d, 4, sg::DType::kF32), c.Broadcast(d, 4, sg::DType::kF32, 0),
                         c.AllGather(d, e, 4, sg::DType::kF32), c.ReduceScatter(e, d, 4, sg::DType::kF32), c.Barrier()})
    if (!s.ok()) {
      std::fprintf(stderr, "nccl smoke: %s\n", s.ToString().c_str());
      return 1;
    }
  cudaMemcpy(back.data(), d, 4 * sizeof(float), cudaMemcpyDeviceToHost);
  for (int i = 0; i < 4; ++i)
    if (back[i] != host[i]) {
      std::fprintf(stderr, "nccl smoke: element %d is %g, expected %g\n", i, back[i], host[i]);
      return 1;
    }
  std::printf("nccl smoke: OK (%lld bytes communicated)\n", static_cast<long long>(c.bytes_communicated()));
  return 0;
}
