// attention_merge (kernels/backend.h): combines attention over two disjoint sets of keys from their outputs and
// logsumexps, for attention over page groups (core/paged_attention.h). One thread per output element; the
// arithmetic is kernels/cpu/attention_merge.cc's.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Log(float x) { return logf(x); }
__device__ inline double Log(double x) { return log(x); }
template <typename T>
__device__ inline T NegInf() {
  return -static_cast<T>(INFINITY);
}

// One thread per element (i, h, e) of out; its row's lse is h * n + i. The lse are merged by a second kernel,
// after every thread has read them.
template <typename T>
__global__ void MergeOutKernel(int64_t n, int64_t heads, int64_t hd, T* out, const T* lse, const T* out_b,
                               const T* lse_b) {
  SG_CUDA_LOOP(idx, n * heads * hd) {
    const int64_t h = (idx / hd) % heads, i = idx / (hd * heads), row = h * n + i;
    const T a = lse[row], b = lse_b[row];
    if (b == NegInf<T>()) continue;
    if (a == NegInf<T>()) {
      out[idx] = out_b[idx];
      continue;
    }
    const T m = a > b ? a : b, wa = Exp(a - m), wb = Exp(b - m), sum = wa + wb;
    out[idx] = wa / sum * out[idx] + wb / sum * out_b[idx];
  }
}

template <typename T>
__global__ void MergeLseKernel(int64_t rows, T* lse, const T* lse_b) {
  SG_CUDA_LOOP(row, rows) {
    const T a = lse[row], b = lse_b[row];
    if (b == NegInf<T>()) continue;
    if (a == NegInf<T>()) {
      lse[row] = b;
      continue;
    }
    const T m = a > b ? a : b;
    lse[row] = m + Log(Exp(a - m) + Exp(b - m));
  }
}

}  // namespace

template <typename T>
void AttentionMerge(const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b) {
  const int64_t elems = s.n * s.heads * s.head_dim, rows = s.n * s.heads;
  if (elems <= 0) return;
  MergeOutKernel<T>
      <<<Blocks(elems, kThreads), kThreads, 0, Stream()>>>(s.n, s.heads, s.head_dim, out, lse, out_b, lse_b);
  End("attention_merge");
  MergeLseKernel<T><<<Blocks(rows, kThreads), kThreads, 0, Stream()>>>(rows, lse, lse_b);
  End("attention_merge");
}

template void AttentionMerge<float>(const AttentionShape&, float*, float*, const float*, const float*);
template void AttentionMerge<double>(const AttentionShape&, double*, double*, const double*, const double*);

}  // namespace sg::cuda
