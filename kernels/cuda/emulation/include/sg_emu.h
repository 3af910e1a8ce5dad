// CPU emulation of the CUDA programming model, for running the CUDA backend's kernels (kernels/cuda/*.cu) on a
// machine without a GPU (CI): the kernels are compiled by g++ from sources rewritten by preprocess.py, which turns
// `kernel<<<grid, block, smem, stream>>>(args)` into sg_emu::Launch(...) and `extern __shared__ T name[];` into a
// pointer to the launch's dynamic shared memory.
//
// Execution model (runtime.cc):
//  * A launch runs synchronously on the calling host thread, blocks one after another in CUDA's order (x fastest),
//    honouring the whole grid (grid-stride loops really stride).
//  * The threads of a block are cooperative fibers on that host thread (own stacks, a tiny context switch). A fiber
//    runs threads in index order until one blocks at a barrier (__syncthreads*, a warp shuffle/vote, __syncwarp);
//    then another fiber starts the next thread. Kernels without barriers therefore run as a plain loop.
//  * __syncthreads is a barrier over the block's live threads: a thread that returned no longer counts
//    (arrive-and-drop). Warp operations are barriers over the lanes named in the mask; a mask naming a lane that has
//    exited or does not exist, or a shuffle reading a lane that did not take part, is reported as a kernel error.
//    A block whose threads wait at different barriers forever is reported as a deadlock.
//  * Static __shared__ variables are `static thread_local` (one copy per host thread; blocks run one at a time).
//    Dynamic shared memory is a fresh buffer per launch, filled with 0xff bytes (NaN) before every block and
//    followed by a guard zone checked after every block.
//  * A bad launch configuration (or shared memory beyond the kernel's limit) is the launch's error, returned by
//    cudaGetLastError. Faults found while a kernel runs (bad warp masks, deadlocks, guard zone overwritten, an
//    injected error) are reported as a GPU reports faults of asynchronous work: by the next synchronizing call
//    (cudaStreamSynchronize, cudaStreamQuery, cudaDeviceSynchronize, a copy into host memory), once, as
//    cudaErrorLaunchFailure. cudaGetErrorString carries the details.
//  * Device memory is not host-addressable: see DeviceAccess below.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __constant__ static
#define __managed__
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

// ---- built-in vector types and indices ----
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// Per host thread; the scheduler sets threadIdx before it resumes a fiber.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

typedef struct CUstream_st* cudaStream_t;
enum cudaError : int;
typedef enum cudaError cudaError_t;

namespace sg_emu {

// ---- implemented in runtime.cc ----
// Linear index of the calling thread in its block, and its lane.
int LinearThread();
inline int LaneId() { return LinearThread() & 31; }
// Block barrier; returns the count of threads whose pred was non-zero (for the __syncthreads_* variants).
int SyncThreads(int pred);
// Warp barrier over `mask` that exchanges `bytes` (<= 8) of `value`; returns the slot of lane `src` (of this
// exchange). src < 0: no read. `what` names the intrinsic in error messages.
const void* WarpExchange(unsigned mask, const void* value, size_t bytes, int src, const char* what);
// The lanes of the last WarpExchange of the calling lane that took part (for ballots): fills `bits` with
// (predicate != 0) per lane, returns the participation mask.
unsigned WarpBallot(unsigned mask, int pred, const char* what);
void* DynamicShared();
// A static __shared__ variable's declaration, reached by a thread: the first thread of a block to reach it fills it
// with 0xff bytes (NaN), as a GPU leaves shared memory undefined at a block's start.
void StaticShared(void* p, size_t bytes);
// Records an error found by the emulated device code (the launch fails with it).
void DeviceError(const char* what);

// Device memory (cudaMalloc): one reserved range of SG_EMU_DEVICE_MEMORY bytes (default: the host's memory), not
// accessible to host code except inside a DeviceAccess scope, which launches, copies, memsets and cuBLAS calls
// open. A stray host access of device memory faults (SIGSEGV, with a message naming it).
void* DeviceAlloc(size_t bytes);  // null when the arena has no room
bool DeviceFree(void* p);         // false: p is not a device block
bool IsDeviceMemory(const void* p);
size_t DeviceMemoryCapacity();
size_t DeviceMemoryUsed();
class DeviceAccess {
 public:
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};

// Makes a later launch of the kernel whose expression contains `kernel` fail, after `skip` launches of it pass:
// its fault (cudaErrorLaunchFailure, "injected kernel error") is reported by the next synchronizing call, as a
// GPU reports a fault of asynchronous work. For tests of the engine's error reporting.
void InjectKernelError(const std::string& kernel, int skip = 0);
// The pending fault of an earlier kernel (cleared), and its details; cudaSuccess when none.
std::pair<cudaError_t, std::string> TakeExecutionError();

struct LaunchInfo {
  const char* kernel;  // the kernel expression as written
  const char* where;   // file:line of the launch
  const void* fn;      // the kernel's function (for cudaFuncSetAttribute)
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  long long max_threads;  // __launch_bounds__ (0: none)
};
cudaError_t LaunchImpl(const LaunchInfo& info, void (*thread_body)(void*), void* ctx);

template <typename... P, typename... A>
inline void Launch(const char* kernel, const char* where, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   long long max_threads, void (*fn)(P...), A&&... args) {
  // The arguments are converted to the parameter types once, as a launch does; every thread gets its own copies.
  using Args = std::tuple<std::decay_t<P>...>;
  Args tuple(std::forward<A>(args)...);
  struct Ctx {
    void (*fn)(P...);
    Args* args;
  } ctx{fn, &tuple};
  auto body = [](void* p) {
    auto* c = static_cast<Ctx*>(p);
    std::apply(c->fn, *c->args);
  };
  LaunchInfo info{kernel, where, reinterpret_cast<const void*>(fn), grid, block, smem, stream, max_threads};
  LaunchImpl(info, +body, &ctx);
}

template <typename T>
inline T Exchange(unsigned mask, T v, int src, const char* what) {
  static_assert(sizeof(T) <= 8, "warp shuffles of at most 8 bytes");
  const void* slot = WarpExchange(mask, &v, sizeof(T), src, what);
  T r;
  std::memcpy(&r, slot, sizeof(T));
  return r;
}

}  // namespace sg_emu

// ---- synchronization ----
inline void __syncthreads() { sg_emu::SyncThreads(0); }
inline int __syncthreads_or(int pred) { return sg_emu::SyncThreads(pred) != 0; }
inline int __syncthreads_and(int pred) {
  // Count of true predicates == live threads is not known here; use !or(!pred).
  return sg_emu::SyncThreads(!pred) == 0;
}
inline int __syncthreads_count(int pred) { return sg_emu::SyncThreads(pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  int dummy = 0;
  sg_emu::WarpExchange(mask, &dummy, sizeof(dummy), -1, "__syncwarp");
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- warp shuffles and votes ----
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  const int lane = sg_emu::LaneId();
  const int src = (lane / width) * width + ((src_lane % width + width) % width);
  return sg_emu::Exchange(mask, var, src, "__shfl_sync");
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  const int lane = sg_emu::LaneId();
  int src = lane ^ lane_mask;
  if (src >= (lane / width + 1) * width || src > 31) src = lane;  // a later group: own value
  return sg_emu::Exchange(mask, var, src, "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = sg_emu::LaneId();
  int src = lane + static_cast<int>(delta);
  if (src >= (lane / width + 1) * width) src = lane;
  return sg_emu::Exchange(mask, var, src, "__shfl_down_sync");
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = sg_emu::LaneId();
  int src = lane - static_cast<int>(delta);
  if (src < (lane / width) * width) src = lane;
  return sg_emu::Exchange(mask, var, src, "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return sg_emu::WarpBallot(mask, pred, "__ballot_sync"); }
inline int __any_sync(unsigned mask, int pred) { return sg_emu::WarpBallot(mask, pred, "__any_sync") != 0; }
inline int __all_sync(unsigned mask, int pred) { return sg_emu::WarpBallot(mask, !pred, "__all_sync") == 0; }
inline unsigned __activemask() { return 0xffffffffu; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }

// ---- device math that the host C library lacks (the rest, expf, exp, log1pf, sincos, ..., is <cmath>) ----
inline float max(float a, float b) { return fmaxf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
#define SG_EMU_INT_MINMAX(T)                       \
  inline T max(T a, T b) { return a < b ? b : a; } \
  inline T min(T a, T b) { return b < a ? b : a; }
SG_EMU_INT_MINMAX(int)
SG_EMU_INT_MINMAX(unsigned)
SG_EMU_INT_MINMAX(long)
SG_EMU_INT_MINMAX(unsigned long)
SG_EMU_INT_MINMAX(long long)
SG_EMU_INT_MINMAX(unsigned long long)
#undef SG_EMU_INT_MINMAX
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float exp10f(float x) { return powf(10.0f, x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float f) {
  int x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline long long __double_as_longlong(double d) {
  long long x;
  std::memcpy(&x, &d, 8);
  return x;
}
inline double __longlong_as_double(long long x) {
  double d;
  std::memcpy(&d, &x, 8);
  return d;
}
