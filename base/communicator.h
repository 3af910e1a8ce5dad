// Collective and point-to-point communication between the ranks of a distributed run, behind one interface with
// real backends only, in //distributed: MPI (Debian OpenMPI, host memory; distributed/mpi_communicator.h) and NCCL
// (device memory, distributed/nccl_communicator.h; host buffers staged through the device,
// distributed/host_staged_nccl.h). Every call returns a status; none throws. The interface is in the base layer so
// that the layers below distributed/ (core's tensor parallelism) can hold a communicator.
//
// Failure model. A backend never waits forever: an operation that has not completed after the communicator's
// timeout (MpiOptions::timeout_s) returns DEADLINE_EXCEEDED naming the operation and the rank, and the
// communicator is then *broken*: its buffers may still be in use by the transport, every later call fails with
// FAILED_PRECONDITION, and the process should report the error and end (Abort ends every rank). A rank that dies
// is usually noticed sooner by the launcher (mpirun ends the job when a rank exits without finalising); the
// timeout covers what it cannot see (a rank stuck or skipping a collective).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"

namespace sg::dist {

enum class ReduceOp { kSum, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "mpi"

  // Element types: kF32, kF64, kI32, kI64 (others are INVALID_ARGUMENT). Counts are elements, not bytes.
  // In place: data (count elements) becomes the reduction over ranks of everyone's data.
  virtual absl::Status AllReduce(void* data, int64_t count, DType dtype, ReduceOp op = ReduceOp::kSum) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction over ranks of block r.
  virtual absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                                     ReduceOp op = ReduceOp::kSum) = 0;
  // recv (size() * send_count elements) gets every rank's send block in rank order.
  virtual absl::Status AllGather(const void* send, void* recv, int64_t send_count, DType dtype) = 0;
  // data of `root` is copied to every rank.
  virtual absl::Status Broadcast(void* data, int64_t count, DType dtype, int root) = 0;
  // Point to point; a Recv whose message has a different element count fails with DATA_LOSS.
  virtual absl::Status Send(const void* data, int64_t count, DType dtype, int peer, int tag = 0) = 0;
  virtual absl::Status Recv(void* data, int64_t count, DType dtype, int peer, int tag = 0) = 0;
  virtual absl::Status Barrier() = 0;
  // Collective: a new communicator over the ranks that pass the same color, ranked by key (ties: by rank here), as
  // MPI_Comm_split; it must not outlive this one. Tensor × data parallel grids split the job into both kinds of group.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) {
    return absl::UnimplementedError(absl::StrCat("the ", backend(), " communicator cannot be split"));
  }
  // Ends every rank of the job with `code` after printing `why` (MPI_Abort). Does not return.
  [[noreturn]] virtual void Abort(int code, const std::string& why) = 0;

  // The same ranks over buffers in the memory of this rank's CUDA device (NCCL), or null: every buffer handed to
  // this communicator is host memory, and device data goes through a host copy (core/tensor_parallel.h). MPI
  // returns null: Debian's OpenMPI is not built CUDA-aware (ompi_info: opal_built_with_cuda_support false).
  virtual Communicator* device_memory() { return nullptr; }

  // Bytes this rank handed to the transport so far (payloads of collectives and sends), for reports.
  virtual int64_t bytes_communicated() const { return bytes_; }

  // Typed conveniences.
  absl::Status AllReduce(std::vector<double>& v, ReduceOp op = ReduceOp::kSum) {
    return AllReduce(v.data(), static_cast<int64_t>(v.size()), DType::kF64, op);
  }
  absl::Status AllReduce(std::vector<int64_t>& v, ReduceOp op = ReduceOp::kSum) {
    return AllReduce(v.data(), static_cast<int64_t>(v.size()), DType::kI64, op);
  }

 protected:
  int64_t bytes_ = 0;
};

// A string -> string configuration (e.g. sg::TrainerRunConfig) hashed field by field (FNV-1a 64 over
// "name=value\n" in name order).
uint64_t ConfigHash(const std::map<std::string, std::string>& config);

// Every rank calls it with its own configuration: OK when all hashes agree, otherwise FAILED_PRECONDITION on
// every rank ("configuration differs across ranks ..."), listing each rank's hash and, on a rank that differs from
// rank 0, the fields that differ (this rank's value against rank 0's).
absl::Status CheckSameConfig(Communicator& comm, const std::map<std::string, std::string>& config);

// Collective: the lowest rank whose `failed` is true, or size() when none is.
absl::StatusOr<int> FirstFailedRank(Communicator& comm, bool failed);

// Collective: OK when every rank's `local` is; otherwise this rank's error, or one naming the first rank that
// failed, so that no rank goes on into a collective the others skip.
absl::Status AgreeAcrossRanks(Communicator& comm, const absl::Status& local);

// Collective: rank 0 runs `write` (only it writes files); every rank returns rank 0's status.
absl::Status WriteOnRankZero(Communicator& comm, const std::function<absl::Status()>& write);

// The per-call timeout of a backend: SEQGRAD_DIST_TIMEOUT_S (seconds) when set, else default_s; an error names
// the variable when it is not a number.
absl::StatusOr<double> TimeoutSeconds(double default_s);

}  // namespace sg::dist
