// What every CUDA kernel file shares: the compute stream, error checks that name the op, launch sizes, device
// scratch, staging of the table's host arrays, and block reductions.
//
// Execution is asynchronous: every op enqueues its kernels on one compute stream and returns. End(op) checks the
// launch and records the op as in flight; faults of the kernels themselves surface at the next check (a chunk's
// start, a step's end, any copy to the host), as a CudaError naming the ops in flight and their chunks.
// SEQGRAD_CUDA_SYNC=1 waits after every op instead, so that a fault names exactly its op. Tensors are device memory
// (runtime.cu's caching allocator, ordered on the compute stream), never touched by host code except through the
// allocator's copies. KV offload's copies run on their own streams, ordered against the compute stream by events.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sg::cuda {

// A failed CUDA call or kernel, as an exception the engine turns into a status (CatchStrategyErrors).
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

cudaStream_t Stream();
// Throws CudaError "<op>: <what> failed: <cuda error string>" unless e == cudaSuccess.
void Check(cudaError_t e, const char* op, const char* what);
// After an op's launches: checks the launch and records the op as in flight (`op` must be a string literal);
// with SEQGRAD_CUDA_SYNC=1 also waits for it and reports its fault.
void End(const char* op);

// Copies device bytes into host memory and waits for them, after the op's launches (call it after them, in place of
// End): the host may read dst once this returns. An async copy into pageable memory "might be synchronous" by CUDA's
// documentation, no more, so a copy back without this wait can be read before it lands.
void Fetch(void* dst, const void* src, size_t bytes, const char* op);
// Device scratch owned by the calling thread, one buffer per slot, grown as needed; valid until the next call
// with the same slot. Reuse by a later op is safe without waiting: both run on the compute stream, in order.
void* Scratch(size_t bytes, int slot, const char* op);
// Copies count host elements into device scratch `slot` (on the compute stream) and returns the device copy. The
// host array may change once this returns (a copy from pageable memory reads it before returning).
template <typename T>
const T* Stage(const T* host, int64_t count, int slot, const char* op) {
  if (!host || count <= 0) return nullptr;
  void* d = Scratch(count * sizeof(T), slot, op);
  Check(cudaMemcpyAsync(d, host, count * sizeof(T), cudaMemcpyHostToDevice, Stream()), op, "staging a host array");
  return static_cast<const T*>(d);
}
// Staging slots: distinct per op argument so that one op can stage several arrays.
enum StageSlot : int { kSlotIds = 0, kSlotLabels, kSlotPageTable, kSlotPageMask, kSlotGradTable, kSlotGradMask,
                       kSlotInvFreq, kSlotRowScale, kSlotOut, kSlotWork0, kSlotWork1, kSlotWork2, kNumSlots };

inline unsigned Blocks(int64_t work, int threads) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);  // grid-stride loops cover the rest
}

// Grid-stride loop over [0, n).
#define SG_CUDA_LOOP(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// Sum of v over the 32 lanes of the warp (every lane gets it).
template <typename T>
__device__ inline T WarpSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. `shared` holds
// 32 elements.
template <typename T>
__device__ inline T BlockSum(T v, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  T r = lane < warps ? shared[lane] : T(0);
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}
template <typename T>
__device__ inline T BlockMax(T v, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  T r = lane < warps ? shared[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) r = max(r, __shfl_xor_sync(0xffffffffu, r, o));
  return r;
}

}  // namespace sg::cuda
