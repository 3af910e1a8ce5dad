#include "distributed/mpi_gtest_main.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "distributed/mpi_communicator.h"

namespace sg::dist {
Communicator* g_comm = nullptr;
}  // namespace sg::dist

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::StatusOr<std::unique_ptr<sg::dist::Communicator>> comm = sg::dist::CreateMpiCommunicator();
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 1;
  }
  sg::dist::g_comm = comm->get();
  if ((*comm)->size() < 2)
    std::fprintf(stderr, "warning: running on %d rank(s); launch with mpirun -np 2\n", (*comm)->size());
  int failed = RUN_ALL_TESTS() != 0;
  (*comm)->AllReduce(&failed, 1, sg::DType::kI32, sg::dist::ReduceOp::kMax).IgnoreError();
  comm->reset();
  return failed;
}
