// The CUDA backend's runtime: compute stream, errors, scratch, the managed-memory allocator, the copy engine for
// KV offload (pinned host memory, one stream per lane), device probe and memory info.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>

#include "core/memory.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace sg::cuda {

namespace {
std::string ErrorText(const char* op, const char* what, cudaError_t e) {
  return std::string(op) + ": " + what + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}
std::atomic<int> g_gemm_math{static_cast<int>(GemmMath::kF32)};
}  // namespace

void SetGemmMath(GemmMath math) { g_gemm_math = static_cast<int>(math); }
GemmMath GetGemmMath() { return static_cast<GemmMath>(g_gemm_math.load()); }

cudaStream_t Stream() {
  static cudaStream_t s = [] {
    cudaStream_t st = nullptr;
    Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cuda runtime", "creating the compute stream");
    return st;
  }();
  return s;
}

void Check(cudaError_t e, const char* op, const char* what) {
  if (e == cudaSuccess) return;
  // A sticky error (illegal address, ...) leaves the context unusable; say so rather than fail later obscurely.
  throw CudaError(ErrorText(op, what, e));
}

void End(const char* op) {
  Check(cudaGetLastError(), op, "kernel launch");
  Check(cudaStreamSynchronize(Stream()), op, "kernel");
}

void* Scratch(size_t bytes, int slot, const char* op) {
  struct Buffers {
    void* p[kNumSlots] = {};
    size_t size[kNumSlots] = {};
    ~Buffers() {
      for (void* q : p)
        if (q) cudaFree(q);
    }
  };
  thread_local Buffers b;
  if (b.size[slot] >= bytes && b.p[slot]) return b.p[slot];
  if (b.p[slot]) Check(cudaFree(b.p[slot]), op, "freeing scratch");
  b.p[slot] = nullptr;
  b.size[slot] = 0;
  const size_t grown = bytes + bytes / 2 + 256;
  Check(cudaMalloc(&b.p[slot], grown), op, "allocating device scratch");
  b.size[slot] = grown;
  return b.p[slot];
}

namespace {

// Managed memory, preferring the GPU: host code that touches a tensor between ops (loading weights, checkpoints,
// gradcheck, numpy views) migrates its pages on demand; kernels find them on the device.
void* ManagedAlloc(size_t bytes) {
  void* p = nullptr;
  const size_t rounded = bytes == 0 ? 256 : (bytes + 255) / 256 * 256;
  cudaError_t e = cudaMallocManaged(&p, rounded, cudaMemAttachGlobal);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: an allocation failure is not sticky
    throw MemoryLimitExceeded(ErrorText("allocate", "cudaMallocManaged", e) + " for " + std::to_string(bytes) +
                              " bytes");
  }
  int device = 0;
  cudaGetDevice(&device);
#if CUDART_VERSION >= 13000
  cudaMemLocation loc{};
  loc.type = cudaMemLocationTypeDevice;
  loc.id = device;
  cudaMemAdvise(p, rounded, cudaMemAdviseSetPreferredLocation, loc);
#else
  cudaMemAdvise(p, rounded, cudaMemAdviseSetPreferredLocation, device);
#endif
  return p;
}
void ManagedFree(void* p) { cudaFree(p); }
void ManagedZero(void* p, size_t bytes) {
  Check(cudaMemsetAsync(p, 0, bytes, Stream()), "zero", "cudaMemsetAsync");
  End("zero");
}

constexpr int kLanes = 4;
cudaStream_t LaneStream(int lane) {
  static cudaStream_t* streams = [] {
    auto* s = new cudaStream_t[kLanes];
    for (int i = 0; i < kLanes; ++i)
      Check(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking), "offload", "creating a copy stream");
    return s;
  }();
  if (lane < 0 || lane >= kLanes) throw CudaError("offload: copy lane out of range");
  return streams[lane];
}
void* PinnedAlloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMallocHost(&p, bytes == 0 ? 64 : bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw MemoryLimitExceeded(ErrorText("offload", "cudaMallocHost (pinned host memory)", e) + " for " +
                              std::to_string(bytes) + " bytes");
  }
  return p;
}

}  // namespace

std::string Probe() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(e);
  }
  if (count == 0) return "no CUDA device on this machine";
  return "";
}

namespace {
std::string SetMatmul(const std::string& mode) {
  if (mode == "fp32") SetGemmMath(GemmMath::kF32);
  else if (mode == "tf32") SetGemmMath(GemmMath::kTF32);
  else if (mode == "bf16") SetGemmMath(GemmMath::kBF16);
  else return "unknown matmul mode '" + mode + "' (choose fp32, tf32 or bf16)";
  return "";
}

cudaDeviceProp Properties() {
  int device = 0;
  Check(cudaGetDevice(&device), "device info", "cudaGetDevice");
  cudaDeviceProp p{};
  Check(cudaGetDeviceProperties(&p, device), "device info", "cudaGetDeviceProperties");
  return p;
}

// Dense FLOP per clock per SM (an FMA counts 2) of the tensor cores / FP units, by architecture: Hopper (sm_90)
// and Ampere datacenter (sm_80). Other GPUs: 0 (MFU not reported).
double PeakFlops(bool f64) {
  const cudaDeviceProp p = Properties();
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  double per_sm = 0;
  const GemmMath math = GetGemmMath();
  if (p.major == 9) per_sm = f64 ? 128 : math == GemmMath::kBF16 ? 4096 : math == GemmMath::kTF32 ? 2048 : 256;
  if (p.major == 8 && p.minor == 0) per_sm = f64 ? 64 : math == GemmMath::kBF16 ? 2048 : math == GemmMath::kTF32 ? 1024 : 128;
  return per_sm * p.multiProcessorCount * clock_khz * 1e3;
}
}  // namespace

void RegisterRuntime(DeviceBackend& b) {
  b.set_matmul = SetMatmul;
  b.name = [] { return std::string(Properties().name); };
  b.peak_flops = PeakFlops;
  b.probe = Probe;
  b.memory_info = [](int64_t* free_bytes, int64_t* total_bytes) {
    size_t f = 0, t = 0;
    Check(cudaMemGetInfo(&f, &t), "memory info", "cudaMemGetInfo");
    *free_bytes = static_cast<int64_t>(f);
    *total_bytes = static_cast<int64_t>(t);
  };
  b.synchronize = [] { Check(cudaDeviceSynchronize(), "synchronize", "cudaDeviceSynchronize"); };
  b.copies.alloc_host = PinnedAlloc;
  b.copies.free_host = [](void* p) { cudaFreeHost(p); };
  b.copies.copy_async = [](void* dst, const void* src, size_t bytes, int lane) {
    Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, LaneStream(lane)), "offload", "cudaMemcpyAsync");
  };
  b.copies.wait = [](int lane) { Check(cudaStreamSynchronize(LaneStream(lane)), "offload", "copy"); };
  RegisterDeviceAllocator(Device::kCUDA, {ManagedAlloc, ManagedFree, ManagedZero});
}

}  // namespace sg::cuda
