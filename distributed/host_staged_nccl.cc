// host_staged_nccl.h under --config=cuda.
#include "distributed/host_staged_nccl.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "distributed/mpi_plugin.h"
#include "distributed/nccl_communicator.h"

namespace sg::dist {

namespace {

class HostStagedNccl : public Communicator {
 public:
  HostStagedNccl(std::unique_ptr<Communicator> bootstrap, std::unique_ptr<Communicator> nccl, int device,
                 cudaStream_t stream)
      : bootstrap_(std::move(bootstrap)), nccl_(std::move(nccl)), device_(device), stream_(stream) {}
  ~HostStagedNccl() override {
    cudaSetDevice(device_);
    if (staging_) cudaFree(staging_);
    cudaStreamDestroy(stream_);
    nccl_.reset();  // before the MPI bootstrap (MPI_Finalize)
    bootstrap_.reset();
  }
  // The MPI bootstrap is split, and a NCCL communicator made over each part on this rank's device.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    absl::StatusOr<std::unique_ptr<Communicator>> mpi = bootstrap_->Split(color, key);
    if (!mpi.ok()) return mpi.status();
    NcclOptions options;
    options.device = device_;
    absl::StatusOr<std::unique_ptr<Communicator>> nccl = CreateNcclCommunicator(mpi->get(), options);
    if (!nccl.ok()) return nccl.status();
    cudaStream_t stream;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess)
      return absl::InternalError(absl::StrCat("cudaStreamCreate failed: CUDA error ", cudaGetErrorString(e)));
    return std::unique_ptr<Communicator>(new HostStagedNccl(std::move(*mpi), std::move(*nccl), device_, stream));
  }
  // Device buffers (a split model on the GPU) go to NCCL directly, without the staging copies.
  Communicator* device_memory() override { return nccl_.get(); }
  int64_t bytes_communicated() const override { return nccl_->bytes_communicated(); }
  int rank() const override { return nccl_->rank(); }
  int size() const override { return nccl_->size(); }
  std::string backend() const override { return "nccl"; }

  absl::Status AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override {
    const int64_t bytes = Bytes(count, dtype);
    if (absl::Status s = Stage("all_reduce", bytes, data, bytes); !s.ok()) return s;
    return Finish("all_reduce", nccl_->AllReduce(staging_, count, dtype, op), data, staging_, bytes);
  }
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) override {
    const int64_t out = Bytes(recv_count, dtype), in = out * size();
    if (absl::Status s = Stage("reduce_scatter", in + out, send, in); !s.ok()) return s;
    char* dst = static_cast<char*>(staging_) + in;
    return Finish("reduce_scatter", nccl_->ReduceScatter(staging_, dst, recv_count, dtype, op), recv, dst, out);
  }
  absl::Status AllGather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    const int64_t in = Bytes(send_count, dtype), out = in * size();
    if (absl::Status s = Stage("all_gather", in + out, send, in); !s.ok()) return s;
    char* dst = static_cast<char*>(staging_) + in;
    return Finish("all_gather", nccl_->AllGather(staging_, dst, send_count, dtype), recv, dst, out);
  }
  absl::Status Broadcast(void* data, int64_t count, DType dtype, int root) override {
    const int64_t bytes = Bytes(count, dtype);
    if (absl::Status s = Stage("broadcast", bytes, data, bytes); !s.ok()) return s;
    return Finish("broadcast", nccl_->Broadcast(staging_, count, dtype, root), data, staging_, bytes);
  }
  absl::Status Send(const void* data, int64_t count, DType dtype, int peer, int tag) override {
    const int64_t bytes = Bytes(count, dtype);
    if (absl::Status s = Stage("send", bytes, data, bytes); !s.ok()) return s;
    return Finish("send", nccl_->Send(staging_, count, dtype, peer, tag), nullptr, nullptr, 0);
  }
  absl::Status Recv(void* data, int64_t count, DType dtype, int peer, int tag) override {
    const int64_t bytes = Bytes(count, dtype);
    if (absl::Status s = Stage("recv", bytes, nullptr, 0); !s.ok()) return s;
    return Finish("recv", nccl_->Recv(staging_, count, dtype, peer, tag), data, staging_, bytes);
  }
  absl::Status Barrier() override { return Finish("barrier", nccl_->Barrier(), nullptr, nullptr, 0); }
  [[noreturn]] void Abort(int code, const std::string& why) override {
    nccl_->Abort(code, why);
    std::_Exit(code);  // not reached
  }

 private:
  // Unknown element types and negative counts: 0 bytes here; the NCCL backend then reports them.
  static int64_t Bytes(int64_t count, DType dtype) {
    switch (dtype) {
      case DType::kF32: case DType::kF64: case DType::kI32: case DType::kI64:
        return std::max<int64_t>(count, 0) * static_cast<int64_t>(DTypeSize(dtype));
      default: return 0;
    }
  }
  absl::Status CudaError(cudaError_t e, const std::string& op, const char* step) const {
    return absl::InternalError(absl::StrCat("rank ", rank(), ": host-staged NCCL ", op, ": ", step,
                                            " failed: CUDA error ", cudaGetErrorString(e)));
  }
  // Grows the staging buffer to `need` bytes and copies `in_bytes` of host `in` to its start.
  absl::Status Stage(const std::string& op, int64_t need, const void* in, int64_t in_bytes) {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError(e, op, "cudaSetDevice");
    need = std::max<int64_t>(need, 16);
    if (need > capacity_) {
      const int64_t grown = std::max(need, capacity_ * 2);
      if (staging_) cudaFree(staging_);
      staging_ = nullptr;
      capacity_ = 0;
      if (cudaError_t e = cudaMalloc(&staging_, static_cast<size_t>(grown)); e != cudaSuccess) {
        staging_ = nullptr;
        return CudaError(e, op, absl::StrCat("cudaMalloc of ", grown, " staging bytes").c_str());
      }
      capacity_ = grown;
    }
    if (in_bytes > 0) {
      if (cudaError_t e = cudaMemcpyAsync(staging_, in, static_cast<size_t>(in_bytes), cudaMemcpyHostToDevice,
                                          stream_);
          e != cudaSuccess)
        return CudaError(e, op, "copy host -> device");
      if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
        return CudaError(e, op, "cudaStreamSynchronize after host -> device");
    }
    return absl::OkStatus();
  }
  // After the (synchronous) NCCL operation: copies `bytes` of device `src` back to host `out`.
  absl::Status Finish(const std::string& op, const absl::Status& done, void* out, const void* src, int64_t bytes) {
    if (!done.ok()) return absl::Status(done.code(), absl::StrCat("host-staged NCCL ", op, ": ", done.message()));
    if (bytes > 0) {
      if (cudaError_t e = cudaMemcpyAsync(out, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_);
          e != cudaSuccess)
        return CudaError(e, op, "copy device -> host");
      if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
        return CudaError(e, op, "cudaStreamSynchronize after device -> host");
    }
    return absl::OkStatus();
  }

  std::unique_ptr<Communicator> bootstrap_, nccl_;
  int device_;
  cudaStream_t stream_;
  void* staging_ = nullptr;
  int64_t capacity_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateHostStagedNcclCommunicator() {
  absl::StatusOr<std::unique_ptr<Communicator>> mpi = JoinMpiJob("NCCL bootstrap (MPI)");
  if (!mpi.ok()) return mpi.status();
  int local_rank = 0;
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"); env && *env) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end == env || *end || v < 0)
      return absl::InvalidArgumentError(absl::StrCat("OMPI_COMM_WORLD_LOCAL_RANK='", env, "' is not a rank"));
    local_rank = static_cast<int>(v);
  }
  const int rank = (*mpi)->rank();
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, ": NCCL needs a CUDA device: ",
        e != cudaSuccess ? cudaGetErrorString(e) : "no device is visible"));
  if (local_rank >= devices)
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, ": local rank ", local_rank,
                                                      " has no GPU of its own (", devices,
                                                      " visible): one GPU per rank"));
  if (cudaError_t e = cudaSetDevice(local_rank); e != cudaSuccess)
    return absl::InternalError(absl::StrCat("rank ", rank, ": cudaSetDevice(", local_rank, ") failed: CUDA error ",
                                            cudaGetErrorString(e)));
  NcclOptions options;
  options.device = local_rank;
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = CreateNcclCommunicator(mpi->get(), options);
  if (!nccl.ok()) return nccl.status();
  cudaStream_t stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess)
    return absl::InternalError(absl::StrCat("rank ", rank, ": cudaStreamCreate failed: CUDA error ",
                                            cudaGetErrorString(e)));
  return std::unique_ptr<Communicator>(new HostStagedNccl(std::move(*mpi), std::move(*nccl), local_rank, stream));
}

bool HostStagedNcclBuilt() { return true; }

}  // namespace sg::dist
