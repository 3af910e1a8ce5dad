// Row-wise and element-wise ops: embedding, RMSNorm, Mamba-2's gated group RMSNorm, RoPE, bias, SwiGLU, the sigmoid
// output gate, Gated DeltaNet's gates, residual add, copy, copies of column blocks, scale, SiLU, softplus; the fused
// layer ops (RoPE into the K/V page write, RMSNorm and SwiGLU with their bf16 roundings). Formulas follow
// kernels/cpu/pointwise.cc, ssm.cc, gated_delta.cc and ssd.cc (same precision of every intermediate).
//
// Determinism: no floating-point atomics anywhere. Sums over rows (dw of the RMSNorms, bias gradients, the gates' a_log
// and dt_bias gradients) go through fixed per-chunk partials and a fixed-order reduction; the embedding gradient adds
// each id's tokens in token order, exactly as the CPU does.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"
#include "kernels/ssd_workspace.h"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;     // element-wise kernels
constexpr int kRowThreads = 256;  // one block per row (RMSNorm)

// Grid for one block per row; rows past the grid are covered by a loop in the kernel.
inline unsigned RowBlocks(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535 * 16));
}

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Log1p(float x) { return log1pf(x); }
__device__ inline double Log1p(double x) { return log1p(x); }

template <typename T>
__device__ inline T Sigmoid(T x) {
  return T(1) / (T(1) + Exp(-x));
}

// torch's softplus: identity above the threshold 20.
template <typename T>
__device__ inline T Softplus(T x) {
  return x > T(20) ? x : Log1p(Exp(x));
}

// ---- embedding ----

template <typename T>
__global__ void EmbeddingForwardKernel(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out) {
  SG_CUDA_LOOP(e, n * d) {
    const int64_t i = e / d, j = e - i * d;
    out[e] = table[static_cast<int64_t>(ids[i]) * d + j];
  }
}

// Block x: groups of tokens sharing an id (grid-stride); y: column chunks. Each thread adds its column of the
// group's dout rows in token order onto the table row: the CPU's order, so the same bits.
template <typename T>
__global__ void EmbeddingBackwardKernel(const int64_t* order, const int64_t* starts, const int64_t* group_ids,
                                        int64_t groups, const T* dout, int64_t d, T* dtable) {
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    T* row = dtable + group_ids[g] * d;
    for (int64_t j = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < d;
         j += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      T acc = row[j];
      for (int64_t t = starts[g]; t < starts[g + 1]; ++t) acc += dout[order[t] * d + j];
      row[j] = acc;
    }
  }
}

// ---- column sums (dw of RMSNorm, bias gradient) ----

// partial[c][j] = sum over rows i of chunk c of a[i][j] (* b[i][j] * r[i] when b is given), in double.
template <typename T>
__global__ void ColumnPartialKernel(const T* a, const T* b, const T* r, int64_t n, int64_t d, int64_t rows_per_chunk,
                                    double* partial) {
  const int64_t c = blockIdx.y;
  const int64_t i0 = c * rows_per_chunk, i1 = min(n, i0 + rows_per_chunk);
  SG_CUDA_LOOP(j, d) {
    double acc = 0;
    for (int64_t i = i0; i < i1; ++i) {
      double v = static_cast<double>(a[i * d + j]);
      if (b) v = v * b[i * d + j] * r[i];
      acc += v;
    }
    partial[c * d + j] = acc;
  }
}

// out[j] += sum_c partial[c][j], chunks in order.
template <typename T>
__global__ void ColumnFinishKernel(const double* partial, int64_t chunks, int64_t d, T* out) {
  SG_CUDA_LOOP(j, d) {
    double acc = 0;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * d + j];
    out[j] += static_cast<T>(acc);
  }
}

// Fixed chunks of rows for column sums (at most 256), so that the result does not depend on scheduling.
struct RowChunks {
  int64_t rows_per_chunk, chunks;
  explicit RowChunks(int64_t n)
      : rows_per_chunk(std::max<int64_t>(32, (n + 255) / 256)), chunks((n + rows_per_chunk - 1) / rows_per_chunk) {}
};

// out[j] += sum_i a[i][j] (* b[i][j] * r[i]).
template <typename T>
void ColumnSums(const T* a, const T* b, const T* r, int64_t n, int64_t d, T* out, const char* op) {
  const RowChunks c(n);
  auto* partial = static_cast<double*>(Scratch(c.chunks * d * sizeof(double), kSlotWork0, op));
  const dim3 grid(Blocks(d, kThreads), static_cast<unsigned>(c.chunks));
  ColumnPartialKernel<T><<<grid, kThreads, 0, Stream()>>>(a, b, r, n, d, c.rows_per_chunk, partial);
  ColumnFinishKernel<T><<<Blocks(d, kThreads), kThreads, 0, Stream()>>>(partial, c.chunks, d, out);
}

// ---- RMSNorm ----

// kRound (f32): y rounded to bf16 values, their bits stored in half unless it is null (rmsnorm_forward_bf16).
template <typename T, bool kRound = false>
__global__ void RmsNormForwardKernel(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd,
                                     uint16_t* half) {
  __shared__ double shared[32];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const T* xi = x + i * d;
    double ss = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += static_cast<double>(xi[j]) * xi[j];
    ss = BlockSum(ss, shared);
    const T r = static_cast<T>(1.0 / sqrt(ss / d + eps));
    if (threadIdx.x == 0) rstd[i] = r;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const T value = xi[j] * r * w[j];
      if constexpr (kRound) {
        const uint16_t h = ToBf16(value);
        y[i * d + j] = FromBf16(h);
        if (half) half[i * d + j] = h;
      } else {
        y[i * d + j] = value;
      }
    }
  }
}

// dx_j = r (w_j dy_j) - x_j r^3 / d * sum_k (w_k dy_k x_k)
template <typename T>
__global__ void RmsNormBackwardKernel(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx,
                                      bool accumulate_dx) {
  __shared__ double shared[32];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const T* xi = x + i * d;
    const T* dyi = dy + i * d;
    const double r = rstd[i];
    double dot = 0;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += static_cast<double>(w[j]) * dyi[j] * xi[j];
    dot = BlockSum(dot, shared);
    const double c = dot * r * r * r / d;
    T* dxi = dx + i * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const T g = static_cast<T>(r * w[j] * dyi[j] - c * xi[j]);
      dxi[j] = accumulate_dx ? dxi[j] + g : g;
    }
  }
}

// ---- Mamba-2's gated group RMSNorm (kernels/cpu/ssd.cc's formulas) ----

template <typename T>
__device__ inline T Silu(T z) {
  return z * Sigmoid(z);
}

// One block per (row, group) i of group_size columns, consecutive in memory: u = x silu(z), out = w u rstd.
template <typename T>
__global__ void GatedGroupRmsnormForwardKernel(const T* x, const T* z, const T* w, int64_t count, int64_t dim,
                                               int64_t group_size, double eps, T* out, T* rstd) {
  __shared__ double shared[32];
  const int64_t per_row = dim / group_size;
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t at = i * group_size, col = i % per_row * group_size;
    double ss = 0;
    for (int64_t j = threadIdx.x; j < group_size; j += blockDim.x) {
      const T u = x[at + j] * Silu(z[at + j]);
      out[at + j] = u;  // read back by this thread only
      ss += static_cast<double>(u) * u;
    }
    ss = BlockSum(ss, shared);
    const T r = static_cast<T>(1.0 / sqrt(ss / group_size + eps));
    if (threadIdx.x == 0) rstd[i] = r;
    for (int64_t j = threadIdx.x; j < group_size; j += blockDim.x) out[at + j] = w[col + j] * (out[at + j] * r);
  }
}

// du_j = r w_j dout_j - u_j r^3 / G sum_k (w_k dout_k u_k); dx = du silu(z), dz = du x s (1 + z (1 - s)).
template <typename T>
__global__ void GatedGroupRmsnormBackwardKernel(const T* dout, const T* x, const T* z, const T* w, const T* rstd,
                                                int64_t count, int64_t dim, int64_t group_size, T* dx, T* dz) {
  __shared__ double shared[32];
  const int64_t per_row = dim / group_size;
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t at = i * group_size, col = i % per_row * group_size;
    const double r = rstd[i];
    double dot = 0;
    for (int64_t j = threadIdx.x; j < group_size; j += blockDim.x)
      dot += static_cast<double>(w[col + j]) * dout[at + j] * x[at + j] * Silu(z[at + j]);
    dot = BlockSum(dot, shared);
    const double c = dot * r * r * r / group_size;
    for (int64_t j = threadIdx.x; j < group_size; j += blockDim.x) {
      const T zj = z[at + j], s = Sigmoid(zj), silu = zj * s, u = x[at + j] * silu;
      const T du = static_cast<T>(r * w[col + j] * dout[at + j] - c * u);
      dx[at + j] = du * silu;
      dz[at + j] = du * x[at + j] * s * (T(1) + zj * (T(1) - s));
    }
  }
}

// partial[c][j] = sum over rows i of chunk c of dout[i][j] u[i][j] rstd[i][j / group_size], in double.
template <typename T>
__global__ void GatedNormWeightPartialKernel(const T* dout, const T* x, const T* z, const T* rstd, int64_t rows,
                                             int64_t dim, int64_t group_size, int64_t rows_per_chunk,
                                             double* partial) {
  const int64_t c = blockIdx.y, per_row = dim / group_size;
  const int64_t i0 = c * rows_per_chunk, i1 = min(rows, i0 + rows_per_chunk);
  SG_CUDA_LOOP(j, dim) {
    double acc = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t at = i * dim + j;
      acc += static_cast<double>(dout[at]) * x[at] * Silu(z[at]) * rstd[i * per_row + j / group_size];
    }
    partial[c * dim + j] = acc;
  }
}

// ---- RoPE ----

// One thread per (token, head, frequency) pair (v[f], v[f + half]); the angle in double as on the CPU.
template <typename T>
__global__ void RopeKernel(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq,
                           double sign) {
  const int64_t half = head_dim / 2;
  SG_CUDA_LOOP(e, n * heads * half) {
    const int64_t f = e % half, token_head = e / half, i = token_head / heads;
    const double angle = static_cast<double>(pos0 + i) * inv_freq[f];
    double s, c;
    sincos(angle, &s, &c);
    const T cs = static_cast<T>(c), sn = static_cast<T>(sign * s);
    T* v = x + token_head * head_dim;
    const T a = v[f], b = v[f + half];
    v[f] = a * cs - b * sn;
    v[f + half] = b * cs + a * sn;
  }
}

// RoPE into the K/V page write: one thread per (token, KV head, frequency) pair, K's pair roped as RopeKernel
// does and V's copied, stored into the token's page as P (T, or bf16 rounded once). table: the page table from
// logical page `first` on, staged; pages absent (-1) are skipped.
template <typename T, typename P>
__global__ void RopeKvWriteKernel(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq,
                                  const int32_t* table, int64_t first, PagedKV<P> kv) {
  const int64_t half = kv.head_dim / 2, row = kv.kv_heads * kv.head_dim;
  SG_CUDA_LOOP(e, n * kv.kv_heads * half) {
    const int64_t f = e % half, token_head = e / half, i = token_head / kv.kv_heads;
    const int64_t t = pos0 + i, page = table[t / kv.page_size - first];
    if (page < 0) continue;
    const double angle = static_cast<double>(t) * inv_freq[f];
    double s, c;
    sincos(angle, &s, &c);
    const T cs = static_cast<T>(c), sn = static_cast<T>(s);
    const T* src = k + token_head * kv.head_dim;
    const T a = src[f], b = src[f + half];
    const int64_t at = page * kv.page_stride + (t % kv.page_size) * row + (token_head - i * kv.kv_heads) * kv.head_dim;
    Narrow(kv.k_pool + at + f, a * cs - b * sn);
    Narrow(kv.k_pool + at + f + half, b * cs + a * sn);
    const T* vsrc = v + token_head * kv.head_dim;
    Narrow(kv.v_pool + at + f, vsrc[f]);
    Narrow(kv.v_pool + at + f + half, vsrc[f + half]);
  }
}

// ---- element-wise ----

template <typename T>
__global__ void AddBiasKernel(T* y, const T* b, int64_t n, int64_t m) {
  SG_CUDA_LOOP(e, n * m) y[e] += b[e % m];
}

template <typename T>
__global__ void SwigluForwardKernel(const T* gate, const T* up, int64_t count, T* out) {
  SG_CUDA_LOOP(i, count) out[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

template <typename T>
__global__ void SwigluBackwardKernel(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup) {
  SG_CUDA_LOOP(i, count) {
    const T g = gate[i], s = Sigmoid(g);
    const T silu = g * s;
    const T go = dout[i], u = up[i];  // read before writing: dgate/dup may alias dout
    dup[i] = go * silu;
    dgate[i] = go * u * (s + g * s * (T(1) - s));
  }
}

// swiglu_forward_bf16: gate and up rounded to bf16 values, out rounded; each half written unless null.
__global__ void SwigluForwardBf16Kernel(const float* gate, const float* up, int64_t count, float* out,
                                        uint16_t* gate_half, uint16_t* up_half, uint16_t* out_half) {
  SG_CUDA_LOOP(i, count) {
    const uint16_t gh = ToBf16(gate[i]), uh = ToBf16(up[i]);
    const float g = FromBf16(gh), u = FromBf16(uh);
    const uint16_t oh = ToBf16(g * Sigmoid(g) * u);
    out[i] = FromBf16(oh);
    if (gate_half) gate_half[i] = gh;
    if (up_half) up_half[i] = uh;
    if (out_half) out_half[i] = oh;
  }
}

__global__ void SwigluBackwardBf16Kernel(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count,
                                         float* dgate, float* dup) {
  SG_CUDA_LOOP(i, count) {
    const float g = FromBf16(gate[i]), s = Sigmoid(g);
    const float silu = g * s;
    const float go = dout[i], u = FromBf16(up[i]);  // read before writing: dgate/dup may alias dout
    dup[i] = go * silu;
    dgate[i] = go * u * (s + g * s * (1.0f - s));
  }
}

template <typename T>
__global__ void SigmoidGateForwardKernel(const T* gate, const T* x, int64_t count, T* out) {
  SG_CUDA_LOOP(i, count) out[i] = Sigmoid(gate[i]) * x[i];
}

template <typename T>
__global__ void SigmoidGateBackwardKernel(const T* dout, const T* gate, const T* x, int64_t count, T* dgate, T* dx) {
  SG_CUDA_LOOP(i, count) {
    const T s = Sigmoid(gate[i]), d = dout[i], xi = x[i];  // read before writing: dgate/dx may alias dout
    dgate[i] = d * xi * s * (T(1) - s);
    dx[i] = d * s;
  }
}

template <typename T>
__global__ void CopyRowsKernel(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, int64_t cols) {
  SG_CUDA_LOOP(e, rows * cols) {
    const int64_t r = e / cols, c = e - r * cols;
    dst[r * ld_dst + c] = src[r * ld_src + c];
  }
}

// Gated DeltaNet's gates: beta = sigmoid(b), g = -exp(a_log) softplus(a + dt_bias).
template <typename T>
__global__ void GdnGatesForwardKernel(const T* a, const T* b, const T* a_log, const T* dt_bias, int64_t n,
                                      int64_t heads, T* g, T* beta) {
  SG_CUDA_LOOP(i, n * heads) {
    const int64_t h = i % heads;
    beta[i] = Sigmoid(b[i]);
    g[i] = -Exp(a_log[h]) * Softplus(a[i] + dt_bias[h]);
  }
}

template <typename T>
__global__ void GdnGatesBackwardKernel(const T* dg, const T* dbeta, const T* a, const T* b, const T* a_log,
                                       const T* dt_bias, int64_t n, int64_t heads, T* da, T* db) {
  SG_CUDA_LOOP(i, n * heads) {
    const int64_t h = i % heads;
    const T x = a[i] + dt_bias[h], s = Sigmoid(b[i]);
    db[i] = dbeta[i] * s * (T(1) - s);
    da[i] = dg[i] * -Exp(a_log[h]) * (x > T(20) ? T(1) : Sigmoid(x));
  }
}

// One block per head: ddt_bias[h] += sum_t da, da_log[h] += sum_t dg g (d g / d a_log = g), each thread over a
// fixed stride of tokens, then BlockSum.
template <typename T>
__global__ void GdnGatesParamsKernel(const T* dg, const T* da, const T* a, const T* a_log, const T* dt_bias, int64_t n,
                                     int64_t heads, T* da_log, T* ddt_bias) {
  __shared__ T block_sum[32];
  const int64_t h = blockIdx.x;
  const T A = -Exp(a_log[h]);
  T sum_log = 0, sum_dt = 0;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const int64_t i = t * heads + h;
    sum_dt += da[i];
    sum_log += dg[i] * A * Softplus(a[i] + dt_bias[h]);
  }
  sum_log = BlockSum(sum_log, block_sum);
  sum_dt = BlockSum(sum_dt, block_sum);
  if (threadIdx.x == 0) {
    da_log[h] += sum_log;
    ddt_bias[h] += sum_dt;
  }
}

template <typename T>
__global__ void AddInplaceKernel(T* y, const T* x, int64_t count) {
  SG_CUDA_LOOP(i, count) y[i] += x[i];
}

template <typename T>
__global__ void ScaleKernel(T* x, int64_t count, double factor) {
  SG_CUDA_LOOP(i, count) x[i] = static_cast<T>(x[i] * factor);
}

template <typename T>
__global__ void FillKernel(T* x, int64_t count, T value) {
  SG_CUDA_LOOP(i, count) x[i] = value;
}

// Converts between storage types (bf16 <-> f32) with bf16.cuh's rounding.
template <typename D, typename S>
__global__ void ConvertKernel(const S* src, int64_t count, D* dst) {
  SG_CUDA_LOOP(i, count) Narrow(dst + i, Widen(src[i]));
}

__global__ void RoundBf16Kernel(float* x, int64_t count, uint16_t* half) {
  SG_CUDA_LOOP(i, count) {
    Narrow(half + i, x[i]);
    x[i] = Widen(half[i]);
  }
}

template <typename T>
__global__ void SiluForwardKernel(const T* x, int64_t count, T* y) {
  SG_CUDA_LOOP(i, count) y[i] = x[i] / (T(1) + Exp(-x[i]));
}

template <typename T>
__global__ void Relu2ForwardKernel(const T* x, int64_t count, T* y) {
  SG_CUDA_LOOP(i, count) y[i] = x[i] > T(0) ? x[i] * x[i] : T(0);
}

template <typename T>
__global__ void Relu2BackwardKernel(const T* dy, const T* x, int64_t count, T* dx) {
  SG_CUDA_LOOP(i, count) dx[i] = x[i] > T(0) ? T(2) * x[i] * dy[i] : T(0);
}

template <typename T>
__global__ void SiluBackwardKernel(const T* dy, const T* x, int64_t count, T* dx) {
  SG_CUDA_LOOP(i, count) {
    const T s = T(1) / (T(1) + Exp(-x[i]));
    dx[i] = dy[i] * s * (T(1) + x[i] * (T(1) - s));
  }
}

template <typename T>
__global__ void SoftplusForwardKernel(const T* x, int64_t count, T* y) {
  SG_CUDA_LOOP(i, count) y[i] = Softplus(x[i]);
}

template <typename T>
__global__ void SoftplusBackwardKernel(const T* dy, const T* x, int64_t count, T* dx) {
  SG_CUDA_LOOP(i, count) dx[i] = x[i] > T(20) ? dy[i] : dy[i] / (T(1) + Exp(-x[i]));
}

}  // namespace

template <typename T>
void EmbeddingForward(const int32_t* ids, int64_t n, const T* table, int64_t d, T* out) {
  if (n <= 0 || d <= 0) return;
  const int32_t* dids = Stage(ids, n, kSlotIds, "embedding_forward");
  EmbeddingForwardKernel<T><<<Blocks(n * d, kThreads), kThreads, 0, Stream()>>>(dids, n, table, d, out);
  End("embedding_forward");
}

template <typename T>
void EmbeddingBackward(const int32_t* ids, int64_t n, const T* dout, int64_t d, T* dtable) {
  if (n <= 0 || d <= 0) return;
  const char* op = "embedding_backward";
  // Group the tokens by id on the host (ids are host memory): a stable sort keeps each id's tokens in token
  // order, so one thread per (id, column) adds them in the CPU's order without atomics.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [ids](int64_t p, int64_t q) { return ids[p] < ids[q]; });
  std::vector<int64_t> starts, group_ids;
  for (int64_t t = 0; t < n; ++t) {
    if (t == 0 || ids[order[t]] != ids[order[t - 1]]) {
      starts.push_back(t);
      group_ids.push_back(ids[order[t]]);
    }
  }
  starts.push_back(n);
  const int64_t groups = static_cast<int64_t>(group_ids.size());
  const int64_t* dorder = Stage(order.data(), n, kSlotIds, op);
  const int64_t* dstarts = Stage(starts.data(), groups + 1, kSlotWork1, op);
  const int64_t* dgroup_ids = Stage(group_ids.data(), groups, kSlotWork2, op);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(groups, 65535 * 16)),
                  static_cast<unsigned>(std::min<int64_t>((d + kThreads - 1) / kThreads, 65535)));
  EmbeddingBackwardKernel<T><<<grid, kThreads, 0, Stream()>>>(dorder, dstarts, dgroup_ids, groups, dout, d, dtable);
  End(op);  // also keeps the host vectors alive until the copies finished
}

template <typename T>
void RmsNormForward(const T* x, const T* w, int64_t n, int64_t d, double eps, T* y, T* rstd) {
  if (n <= 0) return;
  RmsNormForwardKernel<T><<<RowBlocks(n), kRowThreads, 0, Stream()>>>(x, w, n, d, eps, y, rstd, nullptr);
  End("rmsnorm_forward");
}

template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t d, T* dx, T* dw,
                     bool accumulate_dx) {
  if (n <= 0 || d <= 0) return;
  // dw_j += sum_i dy_ij x_ij r_i, first: then dx may even share dy's memory.
  ColumnSums(dy, x, rstd, n, d, dw, "rmsnorm_backward");
  RmsNormBackwardKernel<T><<<RowBlocks(n), kRowThreads, 0, Stream()>>>(dy, x, w, rstd, n, d, dx, accumulate_dx);
  End("rmsnorm_backward");
}

template <typename T>
void GatedGroupRmsnormForward(const T* x, const T* z, const T* w, int64_t rows, int64_t dim, int64_t group_size,
                              double eps, T* out, T* rstd) {
  const char* op = "gated_group_rmsnorm_forward";
  CheckNormGroups(dim, group_size, op);
  const int64_t count = rows * (dim / group_size);
  if (count > 0)
    GatedGroupRmsnormForwardKernel<T>
        <<<RowBlocks(count), kRowThreads, 0, Stream()>>>(x, z, w, count, dim, group_size, eps, out, rstd);
  End(op);
}

template <typename T>
void GatedGroupRmsnormBackward(const T* dout, const T* x, const T* z, const T* w, const T* rstd, int64_t rows,
                               int64_t dim, int64_t group_size, double /*eps*/, T* dx, T* dz, T* dw) {
  const char* op = "gated_group_rmsnorm_backward";
  CheckNormGroups(dim, group_size, op);
  const int64_t count = rows * (dim / group_size);
  if (count > 0) {
    // dw_j += sum_i dout_ij u_ij r_i(group of j) first, over fixed chunks of rows (the sums' order never changes).
    const RowChunks c(rows);
    auto* partial = static_cast<double*>(Scratch(c.chunks * dim * sizeof(double), kSlotWork0, op));
    const dim3 grid(Blocks(dim, kThreads), static_cast<unsigned>(c.chunks));
    GatedNormWeightPartialKernel<T>
        <<<grid, kThreads, 0, Stream()>>>(dout, x, z, rstd, rows, dim, group_size, c.rows_per_chunk, partial);
    ColumnFinishKernel<T><<<Blocks(dim, kThreads), kThreads, 0, Stream()>>>(partial, c.chunks, dim, dw);
    GatedGroupRmsnormBackwardKernel<T>
        <<<RowBlocks(count), kRowThreads, 0, Stream()>>>(dout, x, z, w, rstd, count, dim, group_size, dx, dz);
  }
  End(op);
}

template <typename T>
void Rope(T* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const double* inv_freq, bool inverse) {
  const int64_t half = head_dim / 2;
  if (n <= 0 || heads <= 0 || half <= 0) return;
  const double* dfreq = Stage(inv_freq, half, kSlotInvFreq, "rope");
  RopeKernel<T><<<Blocks(n * heads * half, kThreads), kThreads, 0, Stream()>>>(x, n, heads, head_dim, pos0, dfreq,
                                                                                 inverse ? -1.0 : 1.0);
  End("rope");
}

template <typename T, typename P>
void RopeKvWrite(const T* k, const T* v, int64_t n, int64_t pos0, const double* inv_freq, const PagedKV<P>& kv) {
  const int64_t half = kv.head_dim / 2;
  if (n <= 0 || kv.kv_heads <= 0 || half <= 0) return;
  const char* op = "rope_kv_write";
  const int64_t first = pos0 / kv.page_size, last = (pos0 + n - 1) / kv.page_size;
  const int32_t* table = Stage(kv.page_table + first, last - first + 1, kSlotPageTable, op);
  const double* dfreq = Stage(inv_freq, half, kSlotInvFreq, op);
  RopeKvWriteKernel<T, P><<<Blocks(n * kv.kv_heads * half, kThreads), kThreads, 0, Stream()>>>(
      k, v, n, pos0, dfreq, table, first, kv);
  End("rope_kv_write");
}

void RopeKvWriteBf16(const float* k, const float* v, int64_t n, int64_t pos0, const double* inv_freq,
                     const PagedKV<uint16_t>& kv) {
  RopeKvWrite<float, uint16_t>(k, v, n, pos0, inv_freq, kv);
}

void RmsNormForwardBF16(const float* x, const float* w, int64_t n, int64_t d, double eps, float* y, float* rstd,
                        uint16_t* half) {
  if (n <= 0) return;
  RmsNormForwardKernel<float, true><<<RowBlocks(n), kRowThreads, 0, Stream()>>>(x, w, n, d, eps, y, rstd, half);
  End("rmsnorm_forward_bf16");
}

void SwigluForwardBF16(const float* gate, const float* up, int64_t count, float* out, uint16_t* gate_half,
                       uint16_t* up_half, uint16_t* out_half) {
  if (count <= 0) return;
  SwigluForwardBf16Kernel<<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(gate, up, count, out, gate_half,
                                                                              up_half, out_half);
  End("swiglu_forward_bf16");
}

void SwigluBackwardBF16(const float* dout, const uint16_t* gate, const uint16_t* up, int64_t count, float* dgate,
                        float* dup) {
  if (count <= 0) return;
  SwigluBackwardBf16Kernel<<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dout, gate, up, count, dgate, dup);
  End("swiglu_backward_bf16");
}

template <typename T>
void AddBias(T* y, const T* b, int64_t n, int64_t m) {
  if (n <= 0 || m <= 0) return;
  AddBiasKernel<T><<<Blocks(n * m, kThreads), kThreads, 0, Stream()>>>(y, b, n, m);
  End("add_bias");
}

template <typename T>
void BiasBackward(const T* dy, int64_t n, int64_t m, T* db) {
  if (n <= 0 || m <= 0) return;
  ColumnSums<T>(dy, nullptr, nullptr, n, m, db, "bias_backward");
  End("bias_backward");
}

template <typename T>
void SwigluForward(const T* gate, const T* up, int64_t count, T* out) {
  if (count <= 0) return;
  SwigluForwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(gate, up, count, out);
  End("swiglu_forward");
}

template <typename T>
void SwigluBackward(const T* dout, const T* gate, const T* up, int64_t count, T* dgate, T* dup) {
  if (count <= 0) return;
  SwigluBackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dout, gate, up, count, dgate, dup);
  End("swiglu_backward");
}

template <typename T>
void SigmoidGateForward(const T* gate, const T* x, int64_t count, T* out) {
  if (count <= 0) return;
  SigmoidGateForwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(gate, x, count, out);
  End("sigmoid_gate_forward");
}

template <typename T>
void SigmoidGateBackward(const T* dout, const T* gate, const T* x, int64_t count, T* dgate, T* dx) {
  if (count <= 0) return;
  SigmoidGateBackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dout, gate, x, count, dgate, dx);
  End("sigmoid_gate_backward");
}

template <typename T>
void CopyRows(T* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  CopyRowsKernel<T><<<Blocks(rows * cols, kThreads), kThreads, 0, Stream()>>>(dst, ld_dst, src, ld_src, rows, cols);
  End("copy_rows");
}

template <typename T>
void GdnGatesForward(const T* a, const T* b, const T* a_log, const T* dt_bias, int64_t n, int64_t heads, T* g,
                     T* beta) {
  if (n * heads > 0)
    GdnGatesForwardKernel<T>
        <<<Blocks(n * heads, kThreads), kThreads, 0, Stream()>>>(a, b, a_log, dt_bias, n, heads, g, beta);
  End("gdn_gates_forward");
}

template <typename T>
void GdnGatesBackward(const T* dg, const T* dbeta, const T* a, const T* b, const T* a_log, const T* dt_bias, int64_t n,
                      int64_t heads, T* da, T* db, T* da_log, T* ddt_bias) {
  if (n > 0 && heads > 0) {
    GdnGatesBackwardKernel<T>
        <<<Blocks(n * heads, kThreads), kThreads, 0, Stream()>>>(dg, dbeta, a, b, a_log, dt_bias, n, heads, da, db);
    GdnGatesParamsKernel<T><<<static_cast<unsigned>(heads), kThreads, 0, Stream()>>>(dg, da, a, a_log, dt_bias, n,
                                                                                     heads, da_log, ddt_bias);
  }
  End("gdn_gates_backward");
}

template <typename T>
void AddInplace(T* y, const T* x, int64_t count) {
  if (count <= 0) return;
  AddInplaceKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(y, x, count);
  End("add_inplace");
}

template <typename T>
void Copy(T* dst, const T* src, int64_t count) {
  if (count <= 0 || dst == src) return;
  // cudaMemcpyDefault: unified addressing tells the runtime the direction (device to device here).
  Check(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyDefault, Stream()), "copy", "cudaMemcpyAsync");
  End("copy");
}

template <typename T>
void Fill(T* x, int64_t count, T value) {
  if (count <= 0) return;
  FillKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, value);
  End("fill");
}

template <typename T>
void Scale(T* x, int64_t count, double factor) {
  if (count <= 0) return;
  ScaleKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, factor);
  End("scale");
}

template <typename T>
void SiluForward(const T* x, int64_t count, T* y) {
  if (count <= 0) return;
  SiluForwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, y);
  End("silu_forward");
}

template <typename T>
void SiluBackward(const T* dy, const T* x, int64_t count, T* dx) {
  if (count <= 0) return;
  SiluBackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dy, x, count, dx);
  End("silu_backward");
}

template <typename T>
void Relu2Forward(const T* x, int64_t count, T* y) {
  if (count <= 0) return;
  Relu2ForwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, y);
  End("relu2_forward");
}

template <typename T>
void Relu2Backward(const T* dy, const T* x, int64_t count, T* dx) {
  if (count <= 0) return;
  Relu2BackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dy, x, count, dx);
  End("relu2_backward");
}

template <typename T>
void SoftplusForward(const T* x, int64_t count, T* y) {
  if (count <= 0) return;
  SoftplusForwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, y);
  End("softplus_forward");
}

template <typename T>
void SoftplusBackward(const T* dy, const T* x, int64_t count, T* dx) {
  if (count <= 0) return;
  SoftplusBackwardKernel<T><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(dy, x, count, dx);
  End("softplus_backward");
}

void BF16ToF32Row(const uint16_t* src, int64_t count, float* dst) {
  if (count <= 0) return;
  ConvertKernel<float, uint16_t><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(src, count, dst);
  End("bf16_to_f32");
}

void F32ToBF16Row(const float* src, int64_t count, uint16_t* dst) {
  if (count <= 0) return;
  ConvertKernel<uint16_t, float><<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(src, count, dst);
  End("f32_to_bf16");
}

void RoundBF16(float* x, int64_t count, uint16_t* half) {
  if (count <= 0) return;
  RoundBf16Kernel<<<Blocks(count, kThreads), kThreads, 0, Stream()>>>(x, count, half);
  End("round_bf16");
}

#define SG_INSTANTIATE(T)                                                                                   \
  template void EmbeddingForward<T>(const int32_t*, int64_t, const T*, int64_t, T*);                         \
  template void EmbeddingBackward<T>(const int32_t*, int64_t, const T*, int64_t, T*);                        \
  template void RmsNormForward<T>(const T*, const T*, int64_t, int64_t, double, T*, T*);                     \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, T*, T*, bool);  \
  template void GatedGroupRmsnormForward<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, double, T*, T*); \
  template void GatedGroupRmsnormBackward<T>(const T*, const T*, const T*, const T*, const T*, int64_t, int64_t,      \
                                             int64_t, double, T*, T*, T*);                                          \
  template void Rope<T>(T*, int64_t, int64_t, int64_t, int64_t, const double*, bool);                        \
  template void RopeKvWrite<T, T>(const T*, const T*, int64_t, int64_t, const double*, const PagedKV<T>&);     \
  template void AddBias<T>(T*, const T*, int64_t, int64_t);                                                  \
  template void BiasBackward<T>(const T*, int64_t, int64_t, T*);                                             \
  template void SwigluForward<T>(const T*, const T*, int64_t, T*);                                           \
  template void SwigluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                            \
  template void SigmoidGateForward<T>(const T*, const T*, int64_t, T*);                                      \
  template void SigmoidGateBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                       \
  template void CopyRows<T>(T*, int64_t, const T*, int64_t, int64_t, int64_t);                               \
  template void GdnGatesForward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, T*, T*);         \
  template void GdnGatesBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t, \
                                    T*, T*, T*, T*);                                                          \
  template void AddInplace<T>(T*, const T*, int64_t);                                                        \
  template void Copy<T>(T*, const T*, int64_t);                                                              \
  template void Fill<T>(T*, int64_t, T);                                                                     \
  template void Scale<T>(T*, int64_t, double);                                                               \
  template void SiluForward<T>(const T*, int64_t, T*);                                                       \
  template void SiluBackward<T>(const T*, const T*, int64_t, T*);                                            \
  template void Relu2Forward<T>(const T*, int64_t, T*);                                                      \
  template void Relu2Backward<T>(const T*, const T*, int64_t, T*);                                           \
  template void SoftplusForward<T>(const T*, int64_t, T*);                                                   \
  template void SoftplusBackward<T>(const T*, const T*, int64_t, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
