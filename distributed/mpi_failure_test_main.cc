// A peer that is stuck or dies mid-step (mpi_failure_test.sh): rank 0 must end with a clear error, not hang.
//   mpi_failure_test_main stuck: rank 1 never joins the all-reduce; rank 0 times out (SEQGRAD_DIST_TIMEOUT_S).
//   mpi_failure_test_main die:   rank 1 exits mid-step; mpirun (or rank 0's timeout) ends the job.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "distributed/mpi_communicator.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  absl::StatusOr<std::unique_ptr<sg::dist::Communicator>> comm = sg::dist::CreateMpiCommunicator();
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 1;
  }
  sg::dist::Communicator& c = **comm;
  std::vector<double> grad(1000, 1.0);
  if (!c.AllReduce(grad).ok()) return 1;  // a healthy first step
  if (c.rank() == 1) {
    if (mode == "die") {
      std::fprintf(stderr, "rank 1: dying mid-step\n");
      std::_Exit(7);
    }
    std::this_thread::sleep_for(std::chrono::seconds(120));  // stuck
    return 0;
  }
  const absl::Status s = c.AllReduce(grad);
  std::fprintf(stderr, "rank %d: step 2: %s\n", c.rank(), s.ToString().c_str());
  std::fflush(stderr);
  return s.ok() ? 0 : 3;
}
