// libseqgrad_mpi.so: the MPI communicator for tensor parallelism, loaded by libseqgrad.so only when a trainer asks for
// tp > 1 (cabi/tensor_parallel.cc). libseqgrad.so itself does not link OpenMPI, so programs that never use
// tensor parallelism (and the packages) need no MPI, and a job uses the OpenMPI of its own mpirun.
#include <memory>
#include <string>

#include "distributed/mpi_communicator.h"

// A new communicator over the job (MPI_COMM_WORLD), or null with *error set to a new string; the caller owns both.
extern "C" __attribute__((visibility("default"))) sg::dist::Communicator* seqgrad_internal_create_mpi_communicator(
    std::string** error) {
  absl::StatusOr<std::unique_ptr<sg::dist::Communicator>> c = sg::dist::CreateMpiCommunicator();
  if (c.ok()) return c->release();
  *error = new std::string(c.status().ToString());
  return nullptr;
}
