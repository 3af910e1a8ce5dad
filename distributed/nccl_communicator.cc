#include "distributed/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace sg::dist {

namespace {

absl::StatusOr<ncclDataType_t> NcclType(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    default: return absl::InvalidArgumentError("communicator: only f32, f64, i32 and i64 elements are supported");
  }
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    default: return ncclSum;
  }
}

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorString(e)));
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int device, int rank, int size, double timeout_s,
                   void* scratch)
      : comm_(comm), stream_(stream), device_(device), rank_(rank), size_(size), timeout_s_(timeout_s),
        scratch_(scratch) {}
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (!broken_) ncclCommDestroy(comm_);
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  absl::Status AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override {
    return Run("all_reduce", count, dtype, [&](ncclDataType_t t) {
      return ncclAllReduce(data, data, count, t, NcclOp(op), comm_, stream_);
    });
  }
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) override {
    return Run("reduce_scatter", recv_count, dtype, [&](ncclDataType_t t) {
      return ncclReduceScatter(send, recv, recv_count, t, NcclOp(op), comm_, stream_);
    });
  }
  absl::Status AllGather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    return Run("all_gather", send_count, dtype,
               [&](ncclDataType_t t) { return ncclAllGather(send, recv, send_count, t, comm_, stream_); });
  }
  absl::Status Broadcast(void* data, int64_t count, DType dtype, int root) override {
    if (root < 0 || root >= size_) return BadPeer(root);
    return Run("broadcast", count, dtype,
               [&](ncclDataType_t t) { return ncclBroadcast(data, data, count, t, root, comm_, stream_); });
  }
  absl::Status Send(const void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (peer < 0 || peer >= size_) return BadPeer(peer);
    return Run(absl::StrCat("send to rank ", peer), count, dtype,
               [&](ncclDataType_t t) { return ncclSend(data, count, t, peer, comm_, stream_); });
  }
  absl::Status Recv(void* data, int64_t count, DType dtype, int peer, int tag) override {
    if (peer < 0 || peer >= size_) return BadPeer(peer);
    return Run(absl::StrCat("recv from rank ", peer), count, dtype,
               [&](ncclDataType_t t) { return ncclRecv(data, count, t, peer, comm_, stream_); });
  }
  absl::Status Barrier() override {
    return Run("barrier", 1, DType::kI32, [&](ncclDataType_t t) {
      return ncclAllReduce(scratch_, scratch_, 1, t, ncclSum, comm_, stream_);
    });
  }
  [[noreturn]] void Abort(int code, const std::string& why) override {
    std::fprintf(stderr, "rank %d: aborting: %s\n", rank_, why.c_str());
    std::fflush(stderr);
    if (!broken_) ncclCommAbort(comm_);
    std::_Exit(code);
  }

 private:
  absl::Status BadPeer(int peer) const {
    return absl::InvalidArgumentError(absl::StrCat("peer ", peer, " is not a rank (size ", size_, ")"));
  }
  absl::Status NcclError(ncclResult_t r, const std::string& what) const {
    return absl::InternalError(absl::StrCat("rank ", rank_, ": NCCL ", what, " failed: ", ncclGetErrorString(r),
                                            " (", ncclGetLastError(comm_), ")"));
  }

  template <typename Enqueue>
  absl::Status Run(const std::string& what, int64_t count, DType dtype, Enqueue enqueue) {
    if (broken_)
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank_, ": the communicator is unusable after an earlier failure (", broken_what_, ")"));
    absl::StatusOr<ncclDataType_t> t = NcclType(dtype);
    if (!t.ok()) return t.status();
    if (count < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative element count ", count));
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError(e, what);
    if (ncclResult_t r = enqueue(*t); r != ncclSuccess && r != ncclInProgress) return NcclError(r, what);
    bytes_ += count * static_cast<int64_t>(DTypeSize(dtype));
    const auto start = std::chrono::steady_clock::now();
    for (int64_t polls = 0;; ++polls) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaError(e, absl::StrCat("rank ", rank_, ": ", what));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        Break(what);
        return NcclError(async, what);
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_) {
        Break(what);
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", rank_, " of ", size_, ": NCCL ", what, " did not complete within ", timeout_s_,
            " s (SEQGRAD_DIST_TIMEOUT_S): another rank has probably died or is stuck; the NCCL communicator was "
            "aborted, end the process"));
      }
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void Break(const std::string& what) {
    ncclCommAbort(comm_);
    broken_ = true;
    broken_what_ = what;
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int device_, rank_, size_;
  double timeout_s_;
  void* scratch_;
  bool broken_ = false;
  std::string broken_what_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator* bootstrap,
                                                                     const NcclOptions& options) {
  const int rank = bootstrap ? bootstrap->rank() : 0, size = bootstrap ? bootstrap->size() : 1;
  absl::StatusOr<double> timeout_or = TimeoutSeconds(options.timeout_s);
  if (!timeout_or.ok()) return timeout_or.status();
  const double timeout = *timeout_or;
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, ": NCCL needs a CUDA device: ",
        e != cudaSuccess ? cudaGetErrorString(e) : "no device is visible"));
  const int device = options.device >= 0 ? options.device : rank % devices;
  if (device >= devices)
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": CUDA device ", device, " does not exist (",
                                                   devices, " visible)"));
  // Rendezvous: rank 0's unique id to every rank over the bootstrap (128 bytes as 32 int32).
  ncclUniqueId id;
  static_assert(sizeof(id) % 4 == 0, "ncclUniqueId size");
  std::memset(&id, 0, sizeof(id));
  if (rank == 0)
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return absl::InternalError(absl::StrCat("ncclGetUniqueId failed: ", ncclGetErrorString(r)));
  if (bootstrap)
    if (absl::Status s = bootstrap->Broadcast(&id, sizeof(id) / 4, DType::kI32, 0); !s.ok())
      return absl::Status(s.code(), absl::StrCat("NCCL rendezvous: ", s.message()));
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return CudaError(e, "cudaSetDevice");
  ncclComm_t comm;
  if (ncclResult_t r = ncclCommInitRank(&comm, size, id, rank); r != ncclSuccess)
    return absl::UnavailableError(absl::StrCat("rank ", rank, ": ncclCommInitRank failed: ", ncclGetErrorString(r)));
  cudaStream_t stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommDestroy(comm);
    return CudaError(e, "cudaStreamCreate");
  }
  void* scratch = nullptr;
  if (cudaError_t e = cudaMalloc(&scratch, 16); e != cudaSuccess) {
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
    return CudaError(e, "cudaMalloc");
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, stream, device, rank, size, timeout, scratch));
}

}  // namespace sg::dist
