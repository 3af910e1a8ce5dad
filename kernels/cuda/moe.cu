// Mixture of experts on CUDA: the router (softmax, top-k, optional renormalisation) forward and backward, one block
// per row, and the row gathers, scatter-adds and dots as grid loops. Same math as kernels/cpu/moe.cc and the same
// order of the picks; the softmax's sums run over the block (not in the CPU's order), everything else per row in
// the CPU's order. No atomics: deterministic.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRouteThreads = 128;

// The router's order (kernels/cpu/moe.cc): higher probability first, equal ones by the lower expert index, NaN
// below every number. An expert index below 0 is "none", after everything.
__device__ inline bool Precedes(double pa, int a, double pb, int b) {
  if (a < 0 || b < 0) return b < 0 && a >= 0;
  const bool nan_a = pa != pa, nan_b = pb != pb;
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && pa != pb) return pa > pb;
  return a < b;
}

// The first of the block's candidates (p, e) in the router's order; every thread gets it. `shared_p` and `shared_e`
// hold 32 elements.
__device__ inline void BlockFirst(double& p, int& e, double* shared_p, int* shared_e) {
  for (int o = 16; o > 0; o >>= 1) {
    const double other_p = __shfl_xor_sync(0xffffffffu, p, o);
    const int other_e = __shfl_xor_sync(0xffffffffu, e, o);
    if (Precedes(other_p, other_e, p, e)) p = other_p, e = other_e;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared_p[warp] = p, shared_e[warp] = e;
  __syncthreads();
  const bool live = lane < static_cast<int>(blockDim.x >> 5);
  p = live ? shared_p[lane] : 0.0;
  e = live ? shared_e[lane] : -1;
  for (int o = 16; o > 0; o >>= 1) {
    const double other_p = __shfl_xor_sync(0xffffffffu, p, o);
    const int other_e = __shfl_xor_sync(0xffffffffu, e, o);
    if (Precedes(other_p, other_e, p, e)) p = other_p, e = other_e;
  }
}

// Per row: probs = softmax(logits) in double; then k passes, each taking the first expert after the previous pick
// (each thread scans its experts, then BlockFirst); thread 0 writes top and weights, then normalises them.
template <typename T>
__global__ void MoeRouteKernel(const T* logits, int64_t n, int experts, int k, bool normalize, T* probs, int32_t* top,
                               T* weights) {
  __shared__ double sums[32];
  __shared__ double first_p[32];
  __shared__ int first_e[32];
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* x = logits + row * experts;
    T* p = probs + row * experts;
    double max = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) max = fmax(max, static_cast<double>(x[e]));
    max = BlockMax(max, sums);
    double sum = 0;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) sum += exp(x[e] - max);
    sum = BlockSum(sum, sums);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) p[e] = static_cast<T>(exp(x[e] - max) / sum);
    double prev_p = 0, picked = 0;
    int prev = -1;
    for (int j = 0; j < k; ++j) {
      double best_p = 0;
      int best = -1;
      for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const double pe = p[e];  // this thread's own write
        if ((j == 0 || Precedes(prev_p, prev, pe, e)) && Precedes(pe, e, best_p, best)) best_p = pe, best = e;
      }
      BlockFirst(best_p, best, first_p, first_e);
      prev_p = best_p, prev = best;
      if (threadIdx.x == 0) {
        top[row * k + j] = best;
        weights[row * k + j] = static_cast<T>(best_p);
        picked += best_p;
      }
    }
    if (normalize && threadIdx.x == 0)
      for (int j = 0; j < k; ++j) weights[row * k + j] = static_cast<T>(weights[row * k + j] / picked);
  }
}

// The gradient of expert e's probability in one row: dprobs_extra[e] plus, for each pick j of e, dw_j, or
// (dw_j - sum_i dw_i w_i) / S with normalisation (S the picks' sum, dot_dw_w = sum_i dw_i w_i).
template <typename T>
__device__ double ProbGradient(const T* dw, const int32_t* top, int k, bool normalize, double picked, double dot_dw_w,
                               const T* dprobs_extra, int e) {
  double dp = dprobs_extra ? static_cast<double>(dprobs_extra[e]) : 0.0;
  for (int j = 0; j < k; ++j)
    if (top[j] == e) dp += normalize ? (dw[j] - dot_dw_w) / picked : static_cast<double>(dw[j]);
  return dp;
}

// Per row: dlogits = p (dp - sum dp p). Each thread computes the picks' sums itself (k values, the CPU's order).
template <typename T>
__global__ void MoeRouteBackwardKernel(const T* dweights, const T* probs, const int32_t* top, int64_t n, int experts,
                                       int k, bool normalize, const T* dprobs_extra, T* dlogits) {
  __shared__ double sums[32];
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* dw = dweights + row * k;
    const T* p = probs + row * experts;
    const int32_t* picks = top + row * k;
    double picked = 0, dot_dw_w = 0;
    if (normalize) {
      for (int j = 0; j < k; ++j) picked += p[picks[j]];
      for (int j = 0; j < k; ++j) dot_dw_w += dw[j] * (p[picks[j]] / picked);
    }
    double dot = 0;
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
      dot += ProbGradient(dw, picks, k, normalize, picked, dot_dw_w, dprobs_extra, e) * p[e];
    dot = BlockSum(dot, sums);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const double dp = ProbGradient(dw, picks, k, normalize, picked, dot_dw_w, dprobs_extra, e);
      dlogits[row * experts + e] = static_cast<T>(p[e] * (dp - dot));
    }
  }
}

template <typename T>
__global__ void GatherRowsKernel(const T* src, const int32_t* index, int64_t rows, int64_t cols, T* dst) {
  SG_CUDA_LOOP(i, rows * cols) {
    const int64_t r = i / cols;
    dst[i] = src[index[r] * cols + (i - r * cols)];
  }
}

// Indices are distinct within a call, so no two threads add to one element.
template <typename T>
__global__ void ScatterAddRowsKernel(const T* src, const int32_t* index, const T* scale, int64_t rows, int64_t cols,
                                     T* dst) {
  SG_CUDA_LOOP(i, rows * cols) {
    const int64_t r = i / cols;
    dst[index[r] * cols + (i - r * cols)] += (scale ? scale[r] : T(1)) * src[i];
  }
}

template <typename T>
__global__ void RowDotsKernel(const T* a, const T* b, int64_t rows, int64_t cols, T* out) {
  SG_CUDA_LOOP(r, rows) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += static_cast<double>(a[r * cols + c]) * b[r * cols + c];
    out[r] = static_cast<T>(s);
  }
}

void CheckRoute(int64_t experts, int64_t k, const char* op) {
  if (experts < 1 || k < 1 || k > experts)
    throw CudaError(std::string(op) + ": k = " + std::to_string(k) + " experts per token must lie in [1, " +
                    std::to_string(experts) + "] (the number of experts)");
  if (experts > INT32_MAX)
    throw CudaError(std::string(op) + ": " + std::to_string(experts) + " experts exceed int32 expert indices");
}

}  // namespace

template <typename T>
void MoeRoute(const T* logits, int64_t n, int64_t experts, int64_t k, bool normalize, T* probs, int32_t* top,
              T* weights) {
  const char* op = "moe_route";
  CheckRoute(experts, k, op);
  if (n > 0)
    MoeRouteKernel<T><<<Blocks(n, 1), kRouteThreads, 0, Stream()>>>(
        logits, n, static_cast<int>(experts), static_cast<int>(k), normalize, probs, top, weights);
  End(op);
}

template <typename T>
void MoeRouteBackward(const T* dweights, const T* probs, const int32_t* top, int64_t n, int64_t experts, int64_t k,
                      bool normalize, const T* dprobs_extra, T* dlogits) {
  const char* op = "moe_route_backward";
  CheckRoute(experts, k, op);
  if (n > 0)
    MoeRouteBackwardKernel<T><<<Blocks(n, 1), kRouteThreads, 0, Stream()>>>(
        dweights, probs, top, n, static_cast<int>(experts), static_cast<int>(k), normalize, dprobs_extra, dlogits);
  End(op);
}

template <typename T>
void GatherRows(const T* src, const int32_t* index, int64_t rows, int64_t cols, T* dst) {
  if (rows > 0 && cols > 0)
    GatherRowsKernel<T><<<Blocks(rows * cols, kThreads), kThreads, 0, Stream()>>>(src, index, rows, cols, dst);
  End("gather_rows");
}

template <typename T>
void ScatterAddRows(const T* src, const int32_t* index, const T* scale, int64_t rows, int64_t cols, T* dst) {
  if (rows > 0 && cols > 0)
    ScatterAddRowsKernel<T>
        <<<Blocks(rows * cols, kThreads), kThreads, 0, Stream()>>>(src, index, scale, rows, cols, dst);
  End("scatter_add_rows");
}

template <typename T>
void RowDots(const T* a, const T* b, int64_t rows, int64_t cols, T* out) {
  if (rows > 0) RowDotsKernel<T><<<Blocks(rows, kThreads), kThreads, 0, Stream()>>>(a, b, rows, cols, out);
  End("row_dots");
}

#define SG_INSTANTIATE(T)                                                                                          \
  template void MoeRoute<T>(const T*, int64_t, int64_t, int64_t, bool, T*, int32_t*, T*);                          \
  template void MoeRouteBackward<T>(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, bool, const T*, \
                                    T*);                                                                           \
  template void GatherRows<T>(const T*, const int32_t*, int64_t, int64_t, T*);                                     \
  template void ScatterAddRows<T>(const T*, const int32_t*, const T*, int64_t, int64_t, T*);                       \
  template void RowDots<T>(const T*, const T*, int64_t, int64_t, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
