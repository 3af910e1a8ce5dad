// Cross-entropy over a chunk of logits, per-token log-probabilities and arg max: one block per row (vocabularies
// up to a few hundred thousand), formulas as in kernels/cpu/loss.cc (max shift in T, exp and sums in double).
//
// Determinism: block reductions have a fixed shape, and the loss is summed in row order from the per-row losses by
// one device thread (left on the device, or copied back), so the result does not depend on scheduling.
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {

namespace {

constexpr int kThreads = 512;  // per row

inline unsigned RowBlocks(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535 * 16));
}

// max_j row[j] and log sum_j exp(row[j] - max) of one row, as the CPU computes them; every thread gets both.
// Rows are stored as S and computed in T = Wide<S> (bf16 -> f32, as the CPU widens a bf16 row).
template <typename S, typename T>
__device__ void RowLogSumExp(const S* row, int64_t vocab, T* shared_max, double* shared_sum, T* mx_out,
                             double* log_sum_out) {
  T mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = max(mx, Widen(row[j]));
  mx = BlockMax(mx, shared_max);
  double sum = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += exp(static_cast<double>(Widen(row[j]) - mx));
  sum = BlockSum(sum, shared_sum);
  *mx_out = mx;
  *log_sum_out = log(sum);
}

// Row i becomes scale_i (softmax - onehot(label)); losses[i] = lse - logit[label] (0 for ignored rows).
template <typename S>
__global__ void CrossEntropyKernel(S* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale, double* losses) {
  using T = Wide<S>;
  __shared__ T shared_max[32];
  __shared__ double shared_sum[32];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    S* row = logits + i * vocab;
    const int32_t label = labels[i];
    if (label < 0) {
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) Narrow(row + j, T(0));
      if (threadIdx.x == 0) losses[i] = 0;
      continue;
    }
    T mx;
    double log_sum;
    RowLogSumExp(row, vocab, shared_max, shared_sum, &mx, &log_sum);
    const double lse = static_cast<double>(mx) + log_sum;
    const double scale = row_scale ? row_scale[i] * grad_scale : grad_scale;
    // The CPU's arithmetic: softmax * scale rounded to T, the label's cell then less scale in T, once stored. The
    // thread that owns the label's cell writes the row's loss from it: no thread reads a cell another one writes.
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const T x = Widen(row[j]);
      T v = static_cast<T>(exp(static_cast<double>(x) - lse) * scale);
      if (j == label) {
        v -= static_cast<T>(scale);
        losses[i] = lse - static_cast<double>(x);
      }
      Narrow(row + j, v);
    }
  }
}

// *sum += the losses of rows with a label, in row order.
__global__ void AddValidLossesKernel(const double* losses, const int32_t* labels, int64_t n, double* sum) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i)
    if (labels[i] >= 0) total += losses[i];
  *sum += total;
}

template <typename S>
__global__ void TokenLogprobsKernel(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
  using T = Wide<S>;
  __shared__ T shared_max[32];
  __shared__ double shared_sum[32];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const S* row = logits + i * vocab;
    const int32_t label = labels[i];
    if (label < 0) {
      if (threadIdx.x == 0) out[i] = 0;
      continue;
    }
    T mx;
    double log_sum;
    RowLogSumExp(row, vocab, shared_max, shared_sum, &mx, &log_sum);
    if (threadIdx.x == 0) out[i] = static_cast<double>(Widen(row[label])) - (static_cast<double>(mx) + log_sum);
  }
}

// Whether (a, ia) beats (b, ib): non-NaN beats NaN, then the larger value, then the lower index. A total order,
// so any reduction tree finds the CPU's answer (the first maximal non-NaN entry; 0 when the row is all NaN).
template <typename T>
__device__ inline bool Better(T a, int ia, T b, int ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

template <typename T>
__device__ inline void WarpArgmax(T* v, int* idx) {
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = __shfl_xor_sync(0xffffffffu, *v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, *idx, o);
    if (Better(ov, oi, *v, *idx)) {
      *v = ov;
      *idx = oi;
    }
  }
}

template <typename S>
__global__ void TokenArgmaxKernel(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
  using T = Wide<S>;
  __shared__ T shared_v[32];
  __shared__ int shared_i[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (labels[i] < 0) {
      if (threadIdx.x == 0) out[i] = -1;
      continue;
    }
    const S* row = logits + i * vocab;
    T best = NAN;  // loses to every entry: a NaN with the largest index
    int best_i = INT_MAX;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const T v = Widen(row[j]);
      if (Better(v, static_cast<int>(j), best, best_i)) {
        best = v;
        best_i = static_cast<int>(j);
      }
    }
    WarpArgmax(&best, &best_i);
    __syncthreads();  // the previous row's readers of shared_* are done
    if (lane == 0) {
      shared_v[warp] = best;
      shared_i[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
      best = lane < warps ? shared_v[lane] : T(NAN);
      best_i = lane < warps ? shared_i[lane] : INT_MAX;
      WarpArgmax(&best, &best_i);
      if (lane == 0) out[i] = best_i == INT_MAX ? 0 : best_i;  // an empty row: 0, as the CPU
    }
  }
}

}  // namespace

template <typename T>
double CrossEntropyForwardBackward(T* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale, double* device_sum) {
  if (n <= 0) return 0;
  const char* op = "cross_entropy";
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  const double* dscale = Stage(row_scale, n, kSlotRowScale, op);  // null stays null
  // The per-row losses, then their sum in row order after them: one reduction for both ways of returning it.
  auto* dlosses = static_cast<double*>(Scratch((n + 1) * sizeof(double), kSlotOut, op));
  CrossEntropyKernel<T>
      <<<RowBlocks(n), kThreads, 0, Stream()>>>(logits, dlabels, n, vocab, dscale, grad_scale, dlosses);
  double* dsum = device_sum;
  if (!dsum) {
    dsum = dlosses + n;
    Check(cudaMemsetAsync(dsum, 0, sizeof(double), Stream()), op, "zeroing the sum");
  }
  AddValidLossesKernel<<<1, 1, 0, Stream()>>>(dlosses, dlabels, n, dsum);
  if (device_sum) {
    End(op);
    return 0;
  }
  double total = 0;
  Fetch(&total, dsum, sizeof(double), op);
  return total;
}

template <typename T>
void TokenLogprobs(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
  if (n <= 0) return;
  const char* op = "token_logprobs";
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  auto* dout = static_cast<double*>(Scratch(n * sizeof(double), kSlotOut, op));
  TokenLogprobsKernel<T><<<RowBlocks(n), kThreads, 0, Stream()>>>(logits, dlabels, n, vocab, dout);
  Fetch(out, dout, n * sizeof(double), op);
}

template <typename T>
void TokenArgmax(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
  if (n <= 0) return;
  const char* op = "token_argmax";
  if (vocab > INT_MAX) throw CudaError("token_argmax: vocabulary larger than int32 ids can name");
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  auto* dout = static_cast<int32_t*>(Scratch(n * sizeof(int32_t), kSlotOut, op));
  TokenArgmaxKernel<T><<<RowBlocks(n), kThreads, 0, Stream()>>>(logits, dlabels, n, vocab, dout);
  Fetch(out, dout, n * sizeof(int32_t), op);
}

template double CrossEntropyForwardBackward<float>(float*, const int32_t*, int64_t, int64_t, const double*, double,
                                                   double*);
template double CrossEntropyForwardBackward<double>(double*, const int32_t*, int64_t, int64_t, const double*, double,
                                                    double*);
template void TokenLogprobs<float>(const float*, const int32_t*, int64_t, int64_t, double*);
template void TokenLogprobs<double>(const double*, const int32_t*, int64_t, int64_t, double*);
template void TokenArgmax<float>(const float*, const int32_t*, int64_t, int64_t, int32_t*);
template void TokenArgmax<double>(const double*, const int32_t*, int64_t, int64_t, int32_t*);
// bf16 logit chunks (--dtype=bf16): stored bf16, computed in f32.
template double CrossEntropyForwardBackward<uint16_t>(uint16_t*, const int32_t*, int64_t, int64_t, const double*,
                                                      double, double*);
template void TokenLogprobs<uint16_t>(const uint16_t*, const int32_t*, int64_t, int64_t, double*);
template void TokenArgmax<uint16_t>(const uint16_t*, const int32_t*, int64_t, int64_t, int32_t*);

}  // namespace sg::cuda
