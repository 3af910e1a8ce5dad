#include "distributed/mpi_communicator.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"

namespace sg::dist {

namespace {

bool g_broken = false;  // some communicator timed out: MPI_Finalize could wait for a dead peer

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_broken) MPI_Finalize();
}

absl::Status EnsureMpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return absl::OkStatus();
  int provided = 0;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) return absl::UnavailableError(absl::StrCat("MPI_Init_thread failed with code ", rc));
  std::atexit(FinalizeAtExit);
  return absl::OkStatus();
}

absl::StatusOr<MPI_Datatype> MpiType(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    default: return absl::InvalidArgumentError("communicator: only f32, f64, i32 and i64 elements are supported");
  }
}

MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
    default: return MPI_SUM;
  }
}

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!broken_ && !finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  absl::Status AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override {
    return Run("all_reduce", count, dtype, [&](MPI_Datatype t, int n, MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, data, n, t, MpiOp(op), comm_, r);
    });
  }
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) override {
    return Run("reduce_scatter", recv_count, dtype, [&](MPI_Datatype t, int n, MPI_Request* r) {
      return MPI_Ireduce_scatter_block(send, recv, n, t, MpiOp(op), comm_, r);
    });
  }
  absl::Status AllGather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    return Run("all_gather", send_count, dtype, [&](MPI_Datatype t, int n, MPI_Request* r) {
      return MPI_Iallgather(send, n, t, recv, n, t, comm_, r);
    });
  }
  absl::Status Broadcast(void* data, int64_t count, DType dtype, int root) override {
    if (absl::Status s = CheckPeer(root, "broadcast root"); !s.ok()) return s;
    return Run("broadcast", count, dtype, [&](MPI_Datatype t, int n, MPI_Request* r) {
      return MPI_Ibcast(data, n, t, root, comm_, r);
    });
  }
  absl::Status Send(const void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (absl::Status s = CheckPeer(peer, "send peer"); !s.ok()) return s;
    return Run(absl::StrCat("send to rank ", peer), count, dtype, [&](MPI_Datatype t, int n, MPI_Request* r) {
      return MPI_Isend(data, n, t, peer, tag, comm_, r);
    });
  }
  absl::Status Recv(void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (absl::Status s = CheckPeer(peer, "recv peer"); !s.ok()) return s;
    MPI_Status st;
    absl::Status s = Run(
        absl::StrCat("recv from rank ", peer), count, dtype,
        [&](MPI_Datatype t, int n, MPI_Request* r) { return MPI_Irecv(data, n, t, peer, tag, comm_, r); }, &st);
    if (!s.ok()) return s;
    int got = 0;
    MPI_Get_count(&st, *MpiType(dtype), &got);
    if (got != count)
      return absl::DataLossError(absl::StrCat("rank ", rank_, ": recv from rank ", peer, " got ", got,
                                              " elements, expected ", count));
    return absl::OkStatus();
  }
  absl::Status Barrier() override {
    return Run("barrier", 0, DType::kI32, [&](MPI_Datatype, int, MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    if (broken_)
      return absl::FailedPreconditionError(absl::StrCat("rank ", rank_, ": cannot split a broken communicator"));
    MPI_Comm sub;
    if (int rc = MPI_Comm_split(comm_, color, key, &sub); rc != MPI_SUCCESS) return MpiError(rc, "comm_split");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::unique_ptr<Communicator>(new MpiCommunicator(sub, timeout_s_));
  }
  [[noreturn]] void Abort(int code, const std::string& why) override {
    std::fprintf(stderr, "rank %d: aborting the job: %s\n", rank_, why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  absl::Status CheckPeer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_)
      return absl::InvalidArgumentError(absl::StrCat(what, " ", peer, " is not a rank (size ", size_, ")"));
    return absl::OkStatus();
  }
  absl::Status MpiError(int rc, const std::string& what) const {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return absl::InternalError(absl::StrCat("rank ", rank_, ": MPI ", what, " failed: ", std::string(text, len)));
  }

  // Posts the operation and waits for it (see the header), counting payload bytes.
  template <typename Post>
  absl::Status Run(const std::string& what, int64_t count, DType dtype, Post post, MPI_Status* status = nullptr) {
    if (broken_)
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank_, ": the communicator is unusable after an earlier timeout (", broken_what_, ")"));
    absl::StatusOr<MPI_Datatype> t = MpiType(dtype);
    if (!t.ok()) return t.status();
    if (count < 0 || count > INT_MAX)
      return absl::InvalidArgumentError(absl::StrCat(what, ": element count ", count, " outside [0, ", INT_MAX, "]"));
    MPI_Request req;
    if (int rc = post(*t, static_cast<int>(count), &req); rc != MPI_SUCCESS) return MpiError(rc, what);
    bytes_ += count * static_cast<int64_t>(DTypeSize(dtype));
    const auto start = std::chrono::steady_clock::now();
    MPI_Status local;
    for (int64_t polls = 0;; ++polls) {
      int done = 0;
      if (int rc = MPI_Test(&req, &done, status ? status : &local); rc != MPI_SUCCESS) return MpiError(rc, what);
      if (done) return absl::OkStatus();
      if (polls > 2000) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (timeout_s_ > 0 && waited > timeout_s_) {
          broken_ = g_broken = true;
          broken_what_ = what;
          return absl::DeadlineExceededError(absl::StrCat(
              "rank ", rank_, " of ", size_, ": ", what, " did not complete within ", timeout_s_,
              " s (MPI backend timeout; SEQGRAD_DIST_TIMEOUT_S): another rank has probably died, is stuck or took "
              "a different path; this communicator is unusable now, end the process"));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(polls > 100000 ? 1000 : 20));
      }
    }
  }

  MPI_Comm comm_;
  double timeout_s_;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;
  std::string broken_what_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(const MpiOptions& options) {
  if (absl::Status s = EnsureMpi(); !s.ok()) return s;
  absl::StatusOr<double> timeout_or = TimeoutSeconds(options.timeout_s);
  if (!timeout_or.ok()) return timeout_or.status();
  const double timeout = *timeout_or;
  MPI_Comm comm;
  if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm); rc != MPI_SUCCESS)
    return absl::UnavailableError(absl::StrCat("MPI_Comm_dup failed with code ", rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(new MpiCommunicator(comm, timeout));
}

}  // namespace sg::dist
