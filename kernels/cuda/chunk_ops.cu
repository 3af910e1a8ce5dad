// Work inside a chunk that core once did in host loops over copies of device memory (ops.inc's in-chunk block): LoRA
// dropout, Mamba's A = -exp(A_log) and its gradient, sparse attention's key sums and page scores. Same arithmetic in
// the same order as kernels/cpu/chunk_ops.cc; products and sums that the CPU rounds separately are rounded
// separately here too (MulRn, AddRn: nvcc would fuse them into an FMA), so masks, sums and scores are the CPU's bits.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"
#include "kernels/dropout_mask.h"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ inline T MulRn(T a, T b) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == 8) return __dmul_rn(a, b);
  else return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
template <typename T>
__device__ inline T AddRn(T a, T b) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == 8) return __dadd_rn(a, b);
  else return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }

template <typename T>
__global__ void LoraDropoutKernel(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0,
                                  int64_t col0, double p, T keep, bool accumulate, T* y) {
  SG_CUDA_LOOP(e, n * cols) {
    const int64_t i = e / cols, j = e - i * cols;
    const bool kept = LoraKeep(LoraRowKey(seed, module, pos0 + i), col0 + j, p);
    if (accumulate) {
      if (kept) y[e] = AddRn(y[e], MulRn(x[e], keep));
    } else {
      y[e] = kept ? MulRn(x[e], keep) : T(0);
    }
  }
}

template <typename T>
__global__ void SsmNegExpKernel(const T* a_log, int64_t count, T* a) {
  SG_CUDA_LOOP(i, count) a[i] = -Exp(a_log[i]);
}

template <typename T>
__global__ void SsmNegExpBackwardKernel(const T* da, const T* a, int64_t count, T* da_log) {
  SG_CUDA_LOOP(i, count) da_log[i] = AddRn(da_log[i], MulRn(da[i], a[i]));
}

// One thread per column, down the rows in order (adjacent threads read adjacent columns).
template <typename T>
__global__ void ColumnSumsKernel(const T* x, int64_t rows, int64_t cols, double* sums) {
  SG_CUDA_LOOP(j, cols) {
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) s = AddRn(s, static_cast<double>(x[i * cols + j]));
    sums[j] = s;
  }
}

// One thread per page; each forms the per-KV-head query sums as the CPU does (few pages, short rows: cheap).
__global__ void PageScoresKernel(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                 const double* key_sums, int64_t first, int64_t count, int64_t page_size,
                                 double* scores) {
  const int64_t group = heads / kv_heads, width = kv_heads * head_dim;
  SG_CUDA_LOOP(i, count) {
    const double* k = key_sums + (first + i) * width;
    double acc = 0;
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t e = 0; e < head_dim; ++e) {
        double g = 0;
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
          g = AddRn(g, q_sums[h * head_dim + e] / static_cast<double>(n));
        acc = AddRn(acc, MulRn(g, k[kv * head_dim + e]));
      }
    scores[i] = acc / static_cast<double>(page_size);
  }
}

}  // namespace

template <typename T>
void LoraDropout(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0, int64_t col0,
                 double p, bool accumulate, T* y) {
  if (n * cols <= 0) return;
  const T keep = static_cast<T>(1.0 / (1.0 - p));
  LoraDropoutKernel<T><<<Blocks(n * cols, kThreads), kThreads, 0, Stream()>>>(x, n, cols, seed, module, pos0, col0, p,
                                                                                keep, accumulate, y);
  End("lora_dropout");
}

template <typename T>
void SsmNegExp(const T* a_log, int64_t count, T* a) {
  if (count <= 0) return;
  SsmNegExpKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(a_log, count, a);
  End("ssm_neg_exp");
}

template <typename T>
void SsmNegExpBackward(const T* da, const T* a, int64_t count, T* da_log) {
  if (count <= 0) return;
  SsmNegExpBackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(da, a, count, da_log);
  End("ssm_neg_exp_backward");
}

template <typename T>
void ColumnSumsF64(const T* x, int64_t rows, int64_t cols, double* sums) {
  if (cols <= 0) return;
  ColumnSumsKernel<T><<<Blocks(cols, kThreads), kThreads, 0, Stream()>>>(x, rows, cols, sums);
  End("column_sums_f64");
}

void PageScores(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const double* key_sums, int64_t first, int64_t count, int64_t page_size, double* scores) {
  if (count <= 0) return;
  PageScoresKernel<<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(q_sums, n, heads, kv_heads, head_dim, key_sums,
                                                                       first, count, page_size, scores);
  End("page_scores");
}

#define SG_INSTANTIATE(T)                                                                                      \
  template void LoraDropout<T>(const T*, int64_t, int64_t, uint64_t, uint64_t, int64_t, int64_t, double, bool, \
                               T*);                                                                            \
  template void SsmNegExp<T>(const T*, int64_t, T*);                                                           \
  template void SsmNegExpBackward<T>(const T*, const T*, int64_t, T*);                                         \
  template void ColumnSumsF64<T>(const T*, int64_t, int64_t, double*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
