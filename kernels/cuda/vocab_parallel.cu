// The vocabulary-parallel embedding and cross-entropy on the GPU (ops.inc's tensor-parallel block), the formulas
// of kernels/cpu/vocab_parallel.cc: per row the shard's maximum, sum of exponentials and the label's logit, all in
// double, come back to the host as n or 2n scalars (what the group all-reduces); the logits never leave the device.
//
// Determinism: fixed block reductions; the embedding gradient adds each row's tokens in token order (no atomics).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/common.cuh"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;     // element-wise kernels
constexpr int kRowThreads = 512;  // one block per row

inline unsigned RowGrid(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535 * 16));
}

__device__ inline void NarrowDouble(double* p, double v) { *p = v; }
__device__ inline void NarrowDouble(float* p, double v) { *p = static_cast<float>(v); }
__device__ inline void NarrowDouble(uint16_t* p, double v) { Narrow(p, static_cast<float>(v)); }

template <typename S, typename T>
__global__ void EmbeddingShardForwardKernel(const int32_t* ids, int64_t n, const S* table, int64_t rows, int64_t v0,
                                            int64_t d, T* out) {
  SG_CUDA_LOOP(e, n * d) {
    const int64_t i = e / d, j = e - i * d, r = static_cast<int64_t>(ids[i]) - v0;
    out[e] = r >= 0 && r < rows ? static_cast<T>(Widen(table[r * d + j])) : T(0);
  }
}

// Block x: the groups of tokens sharing a row of this shard; threads: columns. Each group's dout rows are added in
// token order, as the CPU adds them.
template <typename T>
__global__ void EmbeddingShardBackwardKernel(const int64_t* order, const int64_t* starts, const int64_t* group_rows,
                                             int64_t groups, const T* dout, int64_t d, T* dtable) {
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    T* row = dtable + group_rows[g] * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      T acc = row[j];
      for (int64_t t = starts[g]; t < starts[g + 1]; ++t) acc += dout[order[t] * d + j];
      row[j] = acc;
    }
  }
}

// (v, i) replaced by (ov, oi) when that is larger, or equal at a lower column: the first maximal column. Entries
// that never beat -inf (NaN, -inf) keep (-inf, -1), which loses to every recorded one.
__device__ inline void TakeBetter(double ov, int64_t oi, double* v, int64_t* i) {
  if (ov > *v || (ov == *v && oi < *i)) *v = ov, *i = oi;
}

template <typename S>
__global__ void VocabShardMaxKernel(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                                    double* row_max, int64_t* argmax) {
  __shared__ double shared_v[32];
  __shared__ int64_t shared_i[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    double best = -INFINITY;
    int64_t at = -1;
    if (labels[r] >= 0)
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
        if (const double x = static_cast<double>(Widen(logits[r * vocab + j])); x > best) best = x, at = j;
    for (int o = 16; o > 0; o >>= 1)
      TakeBetter(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o), &best, &at);
    __syncthreads();  // the previous row's readers of shared_* are done
    if (lane == 0) shared_v[warp] = best, shared_i[warp] = at;
    __syncthreads();
    if (warp == 0) {
      best = lane < warps ? shared_v[lane] : -INFINITY;
      at = lane < warps ? shared_i[lane] : -1;
      for (int o = 16; o > 0; o >>= 1)
        TakeBetter(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o), &best, &at);
      if (lane == 0) row_max[r] = best, argmax[r] = at < 0 ? -1 : v0 + at;
    }
  }
}

template <typename S>
__global__ void VocabShardSumsKernel(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                                     const double* row_max, double* sums) {
  __shared__ double shared_sum[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int32_t label = labels[r];
    if (label < 0) {
      if (threadIdx.x == 0) sums[r] = sums[n + r] = 0;
      continue;
    }
    double s = 0;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
      s += exp(static_cast<double>(Widen(logits[r * vocab + j])) - row_max[r]);
    s = BlockSum(s, shared_sum);
    if (threadIdx.x == 0) {
      const int64_t l = static_cast<int64_t>(label) - v0;
      sums[r] = s;
      sums[n + r] = l >= 0 && l < vocab ? static_cast<double>(Widen(logits[r * vocab + l])) : 0.0;
    }
  }
}

template <typename S>
__global__ void VocabShardGradientKernel(S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                                         const double* row_max, const double* row_sum, const double* row_scale,
                                         double grad_scale) {
  SG_CUDA_LOOP(e, n * vocab) {
    const int64_t r = e / vocab, j = e - r * vocab;
    const bool labelled = labels[r] >= 0;
    const double s = labelled ? grad_scale * (row_scale ? row_scale[r] : 1.0) : 0.0;
    const double p = labelled ? exp(static_cast<double>(Widen(logits[e])) - row_max[r]) / row_sum[r] : 0.0;
    const bool is_label = labelled && static_cast<int64_t>(labels[r]) - v0 == j;
    NarrowDouble(logits + e, s * (p - (is_label ? 1.0 : 0.0)));
  }
}

template <typename S, typename T>
void EmbeddingShardForward(const int32_t* ids, int64_t n, const S* table, int64_t rows, int64_t v0, int64_t d,
                           T* out) {
  if (n <= 0 || d <= 0) return;
  const char* op = "embedding_shard_forward";
  const int32_t* dids = Stage(ids, n, kSlotIds, op);
  EmbeddingShardForwardKernel<S, T><<<Blocks(n * d, kThreads), kThreads, 0, Stream()>>>(dids, n, table, rows, v0, d,
                                                                                         out);
  End("embedding_shard_forward");
}

template <typename T>
void EmbeddingShardBackward(const int32_t* ids, int64_t n, const T* dout, int64_t rows, int64_t v0, int64_t d,
                            T* dtable) {
  if (n <= 0 || d <= 0) return;
  const char* op = "embedding_shard_backward";
  // This rank's tokens grouped by row on the host (ids are host memory), each row's in token order.
  std::vector<int64_t> order;
  for (int64_t t = 0; t < n; ++t)
    if (ids[t] - v0 >= 0 && ids[t] - v0 < rows) order.push_back(t);
  if (order.empty()) return;
  std::stable_sort(order.begin(), order.end(), [ids](int64_t p, int64_t q) { return ids[p] < ids[q]; });
  std::vector<int64_t> starts, group_rows;
  for (size_t t = 0; t < order.size(); ++t)
    if (t == 0 || ids[order[t]] != ids[order[t - 1]]) {
      starts.push_back(static_cast<int64_t>(t));
      group_rows.push_back(ids[order[t]] - v0);
    }
  starts.push_back(static_cast<int64_t>(order.size()));
  const int64_t groups = static_cast<int64_t>(group_rows.size());
  const int64_t* dorder = Stage(order.data(), static_cast<int64_t>(order.size()), kSlotIds, op);
  const int64_t* dstarts = Stage(starts.data(), groups + 1, kSlotWork1, op);
  const int64_t* drows = Stage(group_rows.data(), groups, kSlotWork2, op);
  EmbeddingShardBackwardKernel<T><<<RowGrid(groups), kThreads, 0, Stream()>>>(dorder, dstarts, drows, groups, dout,
                                                                               d, dtable);
  End("embedding_shard_backward");
}

template <typename S>
void VocabShardMax(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0, double* row_max,
                   int64_t* argmax) {
  if (n <= 0) return;
  const char* op = "vocab_shard_max";
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  auto* dout = static_cast<char*>(Scratch(n * (sizeof(double) + sizeof(int64_t)), kSlotOut, op));
  auto* dmax = reinterpret_cast<double*>(dout);
  auto* dargmax = reinterpret_cast<int64_t*>(dout + n * sizeof(double));
  VocabShardMaxKernel<S><<<RowGrid(n), kRowThreads, 0, Stream()>>>(logits, dlabels, n, vocab, v0, dmax, dargmax);
  Fetch(row_max, dmax, n * sizeof(double), op);
  Fetch(argmax, dargmax, n * sizeof(int64_t), op);
}

template <typename S>
void VocabShardSums(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0,
                    const double* row_max, double* sums) {
  if (n <= 0) return;
  const char* op = "vocab_shard_sums";
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  const double* dmax = Stage(row_max, n, kSlotWork0, op);
  auto* dsums = static_cast<double*>(Scratch(2 * n * sizeof(double), kSlotOut, op));
  VocabShardSumsKernel<S><<<RowGrid(n), kRowThreads, 0, Stream()>>>(logits, dlabels, n, vocab, v0, dmax, dsums);
  Fetch(sums, dsums, 2 * n * sizeof(double), op);
}

template <typename S>
void VocabShardGradient(S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0, const double* row_max,
                        const double* row_sum, const double* row_scale, double grad_scale) {
  if (n <= 0 || vocab <= 0) return;
  const char* op = "vocab_shard_gradient";
  const int32_t* dlabels = Stage(labels, n, kSlotLabels, op);
  const double* dmax = Stage(row_max, n, kSlotWork0, op);
  const double* dsum = Stage(row_sum, n, kSlotWork1, op);
  const double* dscale = Stage(row_scale, n, kSlotRowScale, op);  // null stays null
  VocabShardGradientKernel<S><<<Blocks(n * vocab, kThreads), kThreads, 0, Stream()>>>(
      logits, dlabels, n, vocab, v0, dmax, dsum, dscale, grad_scale);
  End("vocab_shard_gradient");
}

}  // namespace

// Fills t's tensor-parallel block (table.cu).
template <typename T>
void AddVocabParallelOps(OpTable<T>& t) {
  t.embedding_shard_forward = EmbeddingShardForward<T, T>;
  t.embedding_shard_backward = EmbeddingShardBackward<T>;
  t.vocab_shard_max = VocabShardMax<T>;
  t.vocab_shard_sums = VocabShardSums<T>;
  t.vocab_shard_gradient = VocabShardGradient<T>;
  if constexpr (std::is_same_v<T, float>) {
    t.embedding_shard_forward_bf16 = EmbeddingShardForward<uint16_t, float>;
    t.vocab_shard_max_bf16 = VocabShardMax<uint16_t>;
    t.vocab_shard_sums_bf16 = VocabShardSums<uint16_t>;
    t.vocab_shard_gradient_bf16 = VocabShardGradient<uint16_t>;
  }
}

template void AddVocabParallelOps<float>(OpTable<float>&);
template void AddVocabParallelOps<double>(OpTable<double>&);

}  // namespace sg::cuda
