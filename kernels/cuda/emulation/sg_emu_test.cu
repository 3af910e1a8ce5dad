// Tests of the CUDA emulation itself (sg_emu): written as CUDA, rewritten by preprocess.py like the backend's
// kernels. Barriers with early exits, warp shuffles and votes, grid-stride loops over the real grid, dynamic shared
// memory and its limits, launch checks, error detection (bad masks, deadlocks, shared memory overruns) and the
// cuBLAS GEMM.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace {

// The launch's error, else the fault it reported at the next synchronization; cleared, with its text.
std::string TakeError(cudaError_t* code) {
  *code = cudaGetLastError();
  if (*code == cudaSuccess) *code = cudaDeviceSynchronize();
  return cudaGetErrorString(*code);
}

// ---- barriers ----

// Threads >= live return at once; the rest exchange through shared memory across two barriers.
__global__ void EarlyExitKernel(int live, int* out) {
  __shared__ int s[1024];
  const int t = threadIdx.x;
  if (t >= live) return;
  s[t] = t * 10;
  __syncthreads();
  const int other = s[(t + 1) % live];
  __syncthreads();
  s[t] = other + 1;
  __syncthreads();
  out[t] = s[(t + live - 1) % live];
}

TEST(SgEmu, SyncthreadsToleratesEarlyReturn) {
  for (int live : {1, 31, 33, 64, 100, 256}) {
    std::vector<int> out(256, -1);
    int* d = nullptr;
    ASSERT_EQ(cudaMallocManaged(&d, 256 * sizeof(int)), cudaSuccess);
    std::memcpy(d, out.data(), 256 * sizeof(int));
    EarlyExitKernel<<<2, 256>>>(live, d);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    for (int t = 0; t < live; ++t) EXPECT_EQ(d[t], t * 10 + 1) << "live " << live << " t " << t;
    for (int t = live; t < 256; ++t) EXPECT_EQ(d[t], -1);
    cudaFree(d);
  }
}

__global__ void SyncReduceKernel(int* out) {
  const int t = threadIdx.x;
  const int any = __syncthreads_or(t == 77);
  const int none = __syncthreads_or(0);
  const int count = __syncthreads_count(t % 3 == 0);
  const int all = __syncthreads_and(t >= 0);
  const int not_all = __syncthreads_and(t != 5);
  if (t == 0) {
    out[0] = any;
    out[1] = none;
    out[2] = count;
    out[3] = all;
    out[4] = not_all;
  }
}

TEST(SgEmu, SyncthreadsReductions) {
  int* d = nullptr;
  cudaMallocManaged(&d, 5 * sizeof(int));
  SyncReduceKernel<<<1, 200>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(d[0], 1);
  EXPECT_EQ(d[1], 0);
  EXPECT_EQ(d[2], 67);  // 0, 3, ..., 198
  EXPECT_EQ(d[3], 1);
  EXPECT_EQ(d[4], 0);
  cudaFree(d);
}

// Many barriers over 1024 threads: a running prefix through shared memory.
__global__ void ManyBarriersKernel(long long* out) {
  __shared__ long long s[1024];
  const int t = threadIdx.x;
  s[t] = t;
  __syncthreads();
  for (int off = 1; off < 1024; off <<= 1) {
    const long long v = t >= off ? s[t - off] : 0;
    __syncthreads();
    s[t] += v;
    __syncthreads();
  }
  out[t] = s[t];
}

TEST(SgEmu, HillisSteeleScanOver1024Threads) {
  long long* d = nullptr;
  cudaMallocManaged(&d, 1024 * sizeof(long long));
  ManyBarriersKernel<<<1, 1024>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (long long t = 0; t < 1024; ++t) ASSERT_EQ(d[t], t * (t + 1) / 2) << t;
  cudaFree(d);
}

// ---- warps ----

__global__ void ShuffleKernel(int* out, double* dout) {
  const int t = threadIdx.x, lane = t & 31;
  int* o = out + t * 8;
  o[0] = __shfl_xor_sync(0xffffffffu, t, 5);
  o[1] = __shfl_down_sync(0xffffffffu, t, 3);
  o[2] = __shfl_up_sync(0xffffffffu, t, 2);
  o[3] = __shfl_sync(0xffffffffu, t, 7);
  o[4] = __shfl_sync(0xffffffffu, t, lane + 1, 8);  // within groups of 8, wrapping
  o[5] = __shfl_down_sync(0xffffffffu, t, 4, 16);   // own value past the group of 16
  o[6] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 4 == 1));
  o[7] = __any_sync(0xffffffffu, t == 40) * 2 + __all_sync(0xffffffffu, lane < 32);
  double v = t + 0.5;
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
  dout[t] = v;
}

TEST(SgEmu, WarpShufflesAndVotes) {
  const int n = 64;
  int* d = nullptr;
  double* dd = nullptr;
  cudaMallocManaged(&d, n * 8 * sizeof(int));
  cudaMallocManaged(&dd, n * sizeof(double));
  ShuffleKernel<<<1, n>>>(d, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < n; ++t) {
    const int lane = t & 31, base = t - lane;
    const int* o = d + t * 8;
    EXPECT_EQ(o[0], base + (lane ^ 5)) << t;
    EXPECT_EQ(o[1], lane + 3 < 32 ? t + 3 : t) << t;
    EXPECT_EQ(o[2], lane >= 2 ? t - 2 : t) << t;
    EXPECT_EQ(o[3], base + 7) << t;
    EXPECT_EQ(o[4], base + (lane / 8) * 8 + (lane + 1) % 8) << t;
    EXPECT_EQ(o[5], lane % 16 + 4 < 16 ? t + 4 : t) << t;
    EXPECT_EQ(static_cast<unsigned>(o[6]), 0x22222222u) << t;
    EXPECT_EQ(o[7], (t >= 32 ? 2 : 0) + 1) << t;
    double sum = 0;
    for (int l = 0; l < 32; ++l) sum += base + l + 0.5;
    EXPECT_EQ(dd[t], sum) << t;
  }
  cudaFree(d);
  cudaFree(dd);
}

// A full-mask shuffle after some lanes of the warp returned: undefined on a GPU, an error here.
__global__ void ShuffleAfterExitKernel(float* out) {
  if (threadIdx.x >= 20) return;
  float v = threadIdx.x;
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

TEST(SgEmu, ShuffleWithExitedLanesIsAnError) {
  float* d = nullptr;
  cudaMallocManaged(&d, 32 * sizeof(float));
  ShuffleAfterExitKernel<<<1, 32>>>(d);
  cudaError_t e;
  const std::string what = TakeError(&e);
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_NE(what.find("exited"), std::string::npos) << what;
  EXPECT_NE(what.find("ShuffleAfterExitKernel"), std::string::npos) << what;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // reported once
  cudaFree(d);
}

// Blocks of 16 threads: a warp of 16 lanes, so a full mask names lanes that do not exist.
TEST(SgEmu, ShuffleMaskNamingMissingLanesIsAnError) {
  float* d = nullptr;
  cudaMallocManaged(&d, 64 * sizeof(float));
  ShuffleAfterExitKernel<<<1, 16>>>(d);
  cudaError_t e;
  const std::string what = TakeError(&e);
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_NE(what.find("do not exist"), std::string::npos) << what;
  cudaFree(d);
}

// Lanes 0-15 wait at __syncthreads, lanes 16-31 at a shuffle that needs lanes 0-15: a deadlock.
__global__ void DeadlockKernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 16);
  }
}

TEST(SgEmu, DeadlockIsAnError) {
  float* d = nullptr;
  cudaMallocManaged(&d, 32 * sizeof(float));
  DeadlockKernel<<<1, 32>>>(d);
  cudaError_t e;
  const std::string what = TakeError(&e);
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_NE(what.find("deadlock"), std::string::npos) << what;
  // The emulator is usable afterwards.
  int* r = nullptr;
  cudaMallocManaged(&r, 5 * sizeof(int));
  SyncReduceKernel<<<1, 64>>>(r);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(r[2], 22);
  cudaFree(r);
  cudaFree(d);
}

// ---- grids ----

__global__ void GridStrideKernel(int n, int* out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) out[i] = blockIdx.x;
}

TEST(SgEmu, GridStrideLoopsUseTheLaunchedGrid) {
  const int n = 1000;
  int* d = nullptr;
  cudaMallocManaged(&d, n * sizeof(int));
  GridStrideKernel<<<3, 32>>>(n, d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(d[i], (i / 32) % 3) << i;
  cudaFree(d);
}

__global__ void IndexKernel(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  out[block * threads + thread] = block * 1000 + thread;
}

TEST(SgEmu, MultiDimensionalGridsAndBlocks) {
  const dim3 grid(2, 3, 2), block(4, 2, 3);
  const int total = 12 * 24;
  int* d = nullptr;
  cudaMallocManaged(&d, total * sizeof(int));
  std::memset(d, 0xff, total * sizeof(int));
  IndexKernel<<<grid, block>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int b = 0; b < 12; ++b)
    for (int t = 0; t < 24; ++t) ASSERT_EQ(d[b * 24 + t], b * 1000 + t);
  cudaFree(d);
}

// ---- dynamic shared memory ----

__global__ void DynamicSharedKernel(int n, float* out, int overrun) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  out[t] = s[t];  // before any write: the fill pattern (NaN)
  __syncthreads();
  s[t] = static_cast<float>(t);
  __syncthreads();
  out[n + t] = s[n - 1 - t];
  if (overrun && t == 0) s[n + overrun - 1] = 1.0f;
}

TEST(SgEmu, DynamicSharedMemory) {
  const int n = 64;
  float* d = nullptr;
  cudaMallocManaged(&d, 2 * n * sizeof(float));
  DynamicSharedKernel<<<2, n, n * sizeof(float)>>>(n, d, 0);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < n; ++t) {
    EXPECT_TRUE(std::isnan(d[t])) << "shared memory starts as NaN, got " << d[t];
    EXPECT_EQ(d[n + t], n - 1 - t);
  }
  DynamicSharedKernel<<<1, n, n * sizeof(float)>>>(n, d, 3);
  cudaError_t e;
  const std::string what = TakeError(&e);
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_NE(what.find("past the end of dynamic shared memory"), std::string::npos) << what;
  cudaFree(d);
}

TEST(SgEmu, SharedMemoryLimits) {
  float* d = nullptr;
  cudaMallocManaged(&d, 64 * sizeof(float));
  const size_t big = 100 * 1024;
  DynamicSharedKernel<<<1, 32, big>>>(32, d, 0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "over 48 KiB without the attribute";
  ASSERT_EQ(cudaFuncSetAttribute(DynamicSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(big)),
            cudaSuccess);
  DynamicSharedKernel<<<1, 32, big>>>(32, d, 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaFuncSetAttribute(DynamicSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 300 * 1024),
            cudaErrorInvalidValue);
  cudaGetLastError();
  cudaFree(d);
}

// Static shared memory starts as NaN in every block (undefined on a GPU), not with the previous block's values.
__global__ void StaticSharedKernel(float* out) {
  __shared__ float s[64];
  out[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x];
  __syncthreads();
  s[threadIdx.x] = 1.0f;
}

TEST(SgEmu, StaticSharedMemoryStartsAsNaNInEveryBlock) {
  float* d = nullptr;
  cudaMallocManaged(&d, 3 * 64 * sizeof(float));
  StaticSharedKernel<<<3, 64>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < 3 * 64; ++i) EXPECT_TRUE(std::isnan(d[i])) << i << ": " << d[i];
  cudaFree(d);
}

// ---- launch checks ----

__global__ void __launch_bounds__(64) BoundedKernel(int* out) { out[threadIdx.x] = 1; }

TEST(SgEmu, LaunchConfigurationChecks) {
  int* d = nullptr;
  cudaMallocManaged(&d, 2048 * sizeof(int));
  BoundedKernel<<<1, 64>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  BoundedKernel<<<1, 128>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchOutOfResources);
  GridStrideKernel<<<1, 2048>>>(10, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  GridStrideKernel<<<0, 32>>>(10, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  GridStrideKernel<<<dim3(1, 70000), 32>>>(10, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaFree(d);
}

// ---- runtime API ----

TEST(SgEmu, MemoryApi) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 100), cudaSuccess);
  unsigned char first[100];
  ASSERT_EQ(cudaMemcpy(first, p, 100, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(first[99], 0xff) << "device memory starts as 0xff bytes";
  std::vector<char> h(100, 7);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(p, h.data(), 100, cudaMemcpyHostToDevice, s), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(p, 3, 50, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  std::vector<char> back(100);
  ASSERT_EQ(cudaMemcpyAsync(back.data(), p, 100, cudaMemcpyDeviceToHost, s), cudaSuccess);
  // An async copy into host memory may not have landed before a synchronization (as on a GPU): its bytes come
  // then, as they were when it was issued.
  EXPECT_EQ(back[49], 0) << "read before the stream was synchronized";
  EXPECT_EQ(cudaMemsetAsync(p, 5, 100, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(back[49], 3);
  EXPECT_EQ(back[50], 7);
  // The direction must match the pointers.
  EXPECT_EQ(cudaMemcpy(back.data(), p, 100, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(p, back.data(), 100, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  int count = 0;
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 1);
  cudaDeviceProp prop;
  EXPECT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_EQ(prop.major, 9);
  size_t free_b = 0, total_b = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  EXPECT_GT(total_b, 0u);
  EXPECT_STREQ(cudaGetErrorName(cudaErrorInvalidValue), "cudaErrorInvalidValue");
  cudaStreamDestroy(s);
}

// ---- cuBLAS ----

template <typename T>
T At(const std::vector<T>& m, bool trans, int ld, int r, int c) {
  return trans ? m[c + static_cast<size_t>(r) * ld] : m[r + static_cast<size_t>(c) * ld];
}

float RoundTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0xfffu + ((u >> 13) & 1u);
  u &= ~0x1fffu;
  std::memcpy(&x, &u, 4);
  return x;
}

TEST(SgEmu, CublasGemmColumnMajor) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (int mode = 0; mode < 3; ++mode) {
        const int m = 7, n = 5, k = 9, pad = 2;
        const int lda = (ta ? k : m) + pad, ldb = (tb ? n : k) + pad, ldc = m + pad;
        std::vector<float> A(lda * (ta ? m : k)), B(ldb * (tb ? k : n)), C(ldc * n);
        for (float& x : A) x = u(rng);
        for (float& x : B) x = u(rng);
        for (float& x : C) x = u(rng);
        std::vector<float> C0 = C;
        const float alpha = 0.75f, beta = mode == 0 ? -0.5f : 0.0f;
        if (beta == 0.0f)
          for (float& x : C) x = std::numeric_limits<float>::quiet_NaN();  // not read when beta == 0
        auto round = [&](float x) {
          return mode == 1 ? RoundTf32(x) : mode == 2 ? sg::BF16ToF32(sg::F32ToBF16(x)) : x;
        };
        const cublasComputeType_t ct =
            mode == 1 ? CUBLAS_COMPUTE_32F_FAST_TF32 : mode == 2 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
        ASSERT_EQ(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha,
                               A.data(), CUDA_R_32F, lda, B.data(), CUDA_R_32F, ldb, &beta, C.data(), CUDA_R_32F,
                               ldc, ct, CUBLAS_GEMM_DEFAULT),
                  CUBLAS_STATUS_SUCCESS);
        for (int j = 0; j < n; ++j)
          for (int i = 0; i < ldc; ++i) {
            if (i >= m) {
              if (beta == 0.0f) EXPECT_TRUE(std::isnan(C[i + j * ldc])) << "padding written";
              else EXPECT_EQ(C[i + j * ldc], C0[i + j * ldc]) << "padding written";
              continue;
            }
            double acc = 0;
            for (int p = 0; p < k; ++p)
              acc += static_cast<double>(round(At(A, ta, lda, i, p))) * round(At(B, tb, ldb, p, j));
            const float want = static_cast<float>(alpha * acc + (beta == 0.0f ? 0.0 : double(beta) * C0[i + j * ldc]));
            EXPECT_EQ(C[i + j * ldc], want) << ta << tb << " mode " << mode << " (" << i << "," << j << ")";
          }
      }
  // Argument checks as cuBLAS: lda below the stored operand's rows, negative sizes; empty products.
  std::vector<double> a(64, 1.0), b(64, 1.0), c(64, 2.0);
  const double one = 1, zero = 0, half = 0.5;
  EXPECT_EQ(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a.data(), 3, b.data(), 4, &zero, c.data(), 4),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, 4, 4, 6, &one, a.data(), 5, b.data(), 6, &zero, c.data(), 4),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, -1, 4, 4, &one, a.data(), 4, b.data(), 4, &zero, c.data(), 4),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 0, &one, a.data(), 4, b.data(), 1, &half, c.data(), 4),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c[0], 1.0) << "k = 0: C = beta C";
  EXPECT_EQ(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 0, 4, 4, &one, a.data(), 1, b.data(), 4, &zero, c.data(), 1),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c[1], 1.0);
  EXPECT_STREQ(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  cublasDestroy(h);
}

}  // namespace

namespace {

// ---- device memory is not host-addressable ----

TEST(SgEmuDeathTest, HostReadOfDeviceMemoryFaults) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, 64 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH({ volatile float x = d[3]; (void)x; }, "host code accessed emulated device memory");
  EXPECT_DEATH({ d[5] = 1.0f; }, "host code accessed emulated device memory");
  cudaFree(d);
}

__global__ void FillKernel(float* out, int n, float v) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) out[i] = v;
}

TEST(SgEmu, KernelsAndCopiesReachDeviceMemory) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 1000 * sizeof(float)), cudaSuccess);
  FillKernel<<<3, 64>>>(d, 1000, 2.5f);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> h(1000);
  ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (float x : h) ASSERT_EQ(x, 2.5f);
  cudaFree(d);
}

TEST(SgEmu, AllocationsBeyondTheDeviceFail) {
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, total_b + 4096), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total_b), cudaSuccess);
  EXPECT_EQ(free_b - free_after, size_t{1} << 20);
  cudaFree(p);
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total_b), cudaSuccess);
  EXPECT_EQ(free_after, free_b);
}

// A kernel's fault is not the launch's error: it shows at the next synchronization, once.
TEST(SgEmu, InjectedFaultShowsAtTheNextSynchronization) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  sg_emu::InjectKernelError("FillKernel", /*skip=*/1);
  FillKernel<<<1, 64>>>(d, 64, 1.0f);  // passes
  FillKernel<<<1, 64>>>(d, 64, 2.0f);  // fails
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a fault is not a launch error";
  const cudaError_t e = cudaStreamQuery(nullptr);
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_NE(std::string(cudaGetErrorString(e)).find("injected"), std::string::npos) << cudaGetErrorString(e);
  EXPECT_NE(std::string(cudaGetErrorString(e)).find("FillKernel"), std::string::npos) << cudaGetErrorString(e);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "reported once";
  FillKernel<<<1, 64>>>(d, 64, 3.0f);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "injected once";
  cudaFree(d);
}

}  // namespace
