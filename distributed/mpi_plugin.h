// The MPI communicator of an mpirun job, through the plug-in libseqgrad_mpi.so (cabi/mpi_plugin.cc), which this
// loads on first use: programs and libraries that link this instead of :mpi_communicator need no OpenMPI until they
// join a job, and a job uses the OpenMPI of its own mpirun.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/communicator.h"

namespace sg::dist {

// Joins the job (MPI_COMM_WORLD) through the plug-in, found at SEQGRAD_MPI_PLUGIN, else beside the program or
// library holding this code (as loaded, then with symlinks resolved), else in the program's Bazel runfiles. `what`
// (e.g. "--tp") starts the error messages.
absl::StatusOr<std::unique_ptr<Communicator>> JoinMpiJob(absl::string_view what);

}  // namespace sg::dist
