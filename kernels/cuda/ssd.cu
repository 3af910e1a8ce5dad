// Mamba-2's SSD scan on CUDA, forward and backward with the checkpointed states of kernels/ssd_workspace.h (the
// gated group RMSNorm is in pointwise.cu). Same math as kernels/cpu/ssd.cc, and the same order of every sum over the
// state columns j.
//
// A thread owns one row p of a head's state S [head_dim][N]: the update S_p = exp(dt A) S_p + dt x_p B and
// y_p = S_p . C read only that row, so the forward is one thread per (head, row), without barriers. The backward is
// one block per head, a thread per row: dC and dB sum over the rows (a warp's by shuffles, then the warps in order
// through shared memory), the step size's and the decay's gradients with BlockSum. The states live in device memory
// (scratch, the workspace), each row touched by its thread only. No atomics: deterministic. The backward by pairs
// (adjoint sharding) shares the backward's step per token (HeadBackward).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"
#include "kernels/ssd_workspace.h"

namespace sg::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
// The backward runs a thread per row of the state in one block: at most 512, so that its registers fit a block on
// every GPU (64K registers; ptx_test.sh checks the kernel's count against this bound).
constexpr int kMaxBackwardThreads = 512;

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Log1p(float x) { return log1pf(x); }
__device__ inline double Log1p(double x) { return log1p(x); }

// Where one token's rows lie for head h of group h / (heads / groups).
struct SsdRows {
  int64_t heads, head_dim, groups, N;
  __device__ int64_t X(int64_t t, int64_t h) const { return (t * heads + h) * head_dim; }
  __device__ int64_t BC(int64_t t, int64_t h) const { return (t * groups + h / (heads / groups)) * N; }
  __device__ int64_t Gate(int64_t t, int64_t h) const { return t * heads + h; }
};

// The per-token and per-head scalars of the scan, as ssd.cc computes them: dt = clamp(softplus(raw + bias), lo, hi)
// (torch's softplus, threshold 20) and its derivative in raw (0 where the clamp binds or at a limit); A =
// -exp(A_log[h]).
template <typename T>
struct SsdStep {
  T dt, grad, decay;
  __device__ SsdStep(const T* dt_raw, const T* dt_bias, T A, double lo, double hi, const SsdRows& r, int64_t t,
                     int64_t h) {
    const T v = dt_raw[r.Gate(t, h)] + dt_bias[h], sp = v > T(20) ? v : Log1p(Exp(v));
    const T low = static_cast<T>(lo), high = static_cast<T>(hi);
    dt = sp < low ? low : (sp > high ? high : sp);
    grad = sp > low && sp < high ? (v > T(20) ? T(1) : T(1) / (T(1) + Exp(-v))) : T(0);
    decay = Exp(dt * A);
  }
};

// Token t on row p of head h's state (row[j], j < N), from the row `from` (may be row). Returns y_p - D x_p
// (= S_p . C_t).
template <typename T>
__device__ T StepRow(const SsdRows& r, const T* x, const T* B, const T* C, const SsdStep<T>& s, int64_t t, int64_t h,
                     int64_t p, const T* from, T* row) {
  const T* Bt = B + r.BC(t, h);
  const T* Ct = C + r.BC(t, h);
  const T u = s.dt * x[r.X(t, h) + p];
  T acc = 0;
  for (int64_t j = 0; j < r.N; ++j) {
    const T v = s.decay * from[j] + u * Bt[j];
    row[j] = v;
    acc += v * Ct[j];
  }
  return acc;
}

// row[j] = src[j] (src null: zeros), j < N.
template <typename T>
__device__ void CopyRow(const T* src, int64_t N, T* row) {
  for (int64_t j = 0; j < N; ++j) row[j] = src ? src[j] : T(0);
}

// One thread per (head, row); state [heads][head_dim][N] is scratch.
template <typename T>
__global__ void SsdForwardKernel(SsdRows r, const T* x, const T* dt_raw, const T* dt_bias, const T* A_log, const T* B,
                                 const T* C, const T* D, const T* s0, int64_t n, double lo, double hi, T* state, T* y,
                                 T* s_final) {
  SG_CUDA_LOOP(c, r.heads * r.head_dim) {
    const int64_t h = c / r.head_dim, p = c % r.head_dim, at = c * r.N;
    const T A = -Exp(A_log[h]), Dh = D ? D[h] : T(0);
    T* row = state + at;
    CopyRow(s0 ? s0 + at : nullptr, r.N, row);
    for (int64_t t = 0; t < n; ++t) {
      const SsdStep<T> s(dt_raw, dt_bias, A, lo, hi, r, t, h);
      const T acc = StepRow(r, x, B, C, s, t, h, p, row, row);
      y[r.X(t, h) + p] = acc + Dh * x[r.X(t, h) + p];
    }
    if (s_final) CopyRow(row, r.N, s_final + at);
  }
}

// The inputs of the backward kernels.
template <typename T>
struct SsdBackwardArgs {
  const T *dy, *ds_final, *x, *dt_raw, *dt_bias, *A_log, *B, *C, *D, *s0;
  T *dx, *ddt_raw, *ddt_bias, *dA_log, *dD, *ds0;
};

// One head's backward in a block (blockIdx.x = head h, thread p = row p; threads past head_dim only join the sums),
// token by token: what SsdBackwardKernel and SsdBackwardPairsKernel share. The workspace's dC_heads, dB_heads
// [n][heads][N] get this head's rows; warp_dC, warp_dB [warps][N] are shared memory, block_sum 32 shared values.
template <typename T>
struct HeadBackward {
  const SsdRows& r;
  const SsdBackwardArgs<T>& a;
  const SsdWorkspace& w;
  T* workspace;
  double lo, hi;
  T *warp_dC, *warp_dB, *block_sum;
  int64_t h = blockIdx.x, p = threadIdx.x;
  bool active = p < r.head_dim;
  T A = -Exp(a.A_log[h]), Dh = a.D ? a.D[h] : T(0);
  T sum_dt_bias = 0, sum_A = 0, dD_part = 0;  // thread 0's sums over the tokens; each thread's part of dD

  // Token t: prev = this row of S_{t-1}; dS = this row of the gradient of S_t from the later tokens, which becomes
  // that of S_{t-1}.
  __device__ void Token(int64_t t, const T* prev, T* dS) {
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t N = r.N;
    const SsdStep<T> s(a.dt_raw, a.dt_bias, A, lo, hi, r, t, h);
    const T* Bt = a.B + r.BC(t, h);
    const T* Ct = a.C + r.BC(t, h);
    const T xp = active ? a.x[r.X(t, h) + p] : T(0), dyp = active ? a.dy[r.X(t, h) + p] : T(0), u = s.dt * xp;
    // y = S_t C + D x: dC += S_t^T dy, dS_t += dy C^T. S_t = decay S_{t-1} + u B^T: d decay, du = dS_t B,
    // dB += dS_t^T u, dS_{t-1} = decay dS_t.
    T du = 0, ddecay = 0;
    for (int64_t j = 0; j < N; ++j) {
      T part_C = 0, part_B = 0;
      if (active) {
        part_C = (s.decay * prev[j] + u * Bt[j]) * dyp;
        const T g = dS[j] + dyp * Ct[j];
        du += g * Bt[j];
        ddecay += g * prev[j];
        part_B = g * u;
        dS[j] = s.decay * g;
      }
      part_C = WarpSum(part_C);
      part_B = WarpSum(part_B);
      if (lane == 0) {
        warp_dC[warp * N + j] = part_C;
        warp_dB[warp * N + j] = part_B;
      }
    }
    if (active) a.dx[r.X(t, h) + p] = Dh * dyp + s.dt * du;
    dD_part += dyp * xp;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
      T sum_C = 0, sum_B = 0;
      for (int ww = 0; ww < warps; ++ww) {
        sum_C += warp_dC[ww * N + j];
        sum_B += warp_dB[ww * N + j];
      }
      workspace[w.dC_heads + r.Gate(t, h) * N + j] = sum_C;
      workspace[w.dB_heads + r.Gate(t, h) * N + j] = sum_B;
    }
    // BlockSum's barriers also keep the next token from overwriting warp_dC before everyone has read it.
    const T ddt_direct = BlockSum(xp * du, block_sum);
    const T ddecay_t = BlockSum(ddecay, block_sum);
    if (threadIdx.x == 0) {
      const T ddt = ddt_direct + ddecay_t * s.decay * A;  // decay = exp(dt A)
      a.ddt_raw[r.Gate(t, h)] = ddt * s.grad;
      sum_dt_bias += ddt * s.grad;
      sum_A += ddecay_t * s.decay * s.dt;
    }
  }

  // After the last token: the per-head parameters' gradients.
  __device__ void Finish() {
    const T dD_h = BlockSum(dD_part, block_sum);
    if (threadIdx.x == 0) {
      a.ddt_bias[h] += sum_dt_bias;
      a.dA_log[h] += sum_A * A;  // dA / dA_log = A
      if (a.D) a.dD[h] += dD_h;
    }
  }
};

// The scan's backward, one head per block: checkpoints every w.block tokens, then the blocks last to first, each
// block's states recomputed from its checkpoint and walked backward.
template <typename T>
__global__ void SsdBackwardKernel(SsdRows r, SsdWorkspace w, int64_t n, double lo, double hi, SsdBackwardArgs<T> a,
                                  T* workspace) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ T block_sum[32];
  T* warp_dC = reinterpret_cast<T*>(smem);
  HeadBackward<T> hb{r, a, w, workspace, lo, hi, warp_dC, warp_dC + blockDim.x / 32 * r.N, block_sum};
  const int64_t h = hb.h, p = hb.p, N = r.N, state = r.head_dim * N;
  const int64_t row = (hb.active ? p : 0) * N;  // a valid row for the idle threads' addresses
  T* checkpoints = workspace + w.checkpoints + h * w.blocks * state + row;
  T* states = workspace + w.block_states + h * w.block * state + row;
  T* dS = workspace + w.state_grad + h * state + row;
  if (hb.active) {
    // The state at the start of every block.
    if (w.blocks > 0) CopyRow(a.s0 ? a.s0 + h * state + row : nullptr, N, checkpoints);
    for (int64_t b = 0; b + 1 < w.blocks; ++b) {
      T* next = checkpoints + (b + 1) * state;
      for (int64_t t = b * w.block; t < (b + 1) * w.block; ++t)
        StepRow(r, a.x, a.B, a.C, SsdStep<T>(a.dt_raw, a.dt_bias, hb.A, lo, hi, r, t, h), t, h, p,
                t == b * w.block ? checkpoints + b * state : next, next);
    }
    CopyRow(a.ds_final ? a.ds_final + h * state + row : nullptr, N, dS);
  }
  for (int64_t b = w.blocks - 1; b >= 0; --b) {
    const int64_t t0 = b * w.block, t1 = t0 + w.block < n ? t0 + w.block : n;
    if (hb.active) {
      CopyRow(checkpoints + b * state, N, states);
      for (int64_t t = t0; t + 1 < t1; ++t)
        StepRow(r, a.x, a.B, a.C, SsdStep<T>(a.dt_raw, a.dt_bias, hb.A, lo, hi, r, t, h), t, h, p,
                states + (t - t0) * state, states + (t - t0 + 1) * state);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) hb.Token(t, states + (t - t0) * state, dS);
  }
  if (hb.active && a.ds0) CopyRow<T>(dS, N, a.ds0 + h * state + row);
  hb.Finish();
}

// The tokens right after the chunk that the pairs read, and which pairs: t < span, t - i < window.
template <typename T>
struct SsdLater {
  const T *dy, *dt_raw, *C;
  int64_t span, window;
};

// Adjoint sharding, one head per block, tokens in order: the state gradient of token i from its pairs (t, i),
// i < t < min(span, i + window), each thread summing its row (the product of decays built one factor at a time, as
// the CPU does), then token i's backward and the state stepped on through it. A direct O(n * window) loop: exact
// and simple, not fast.
template <typename T>
__global__ void SsdBackwardPairsKernel(SsdRows r, SsdWorkspace w, int64_t n, double lo, double hi, SsdBackwardArgs<T> a,
                                       SsdLater<T> later, T* workspace) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ T block_sum[32];
  T* warp_dC = reinterpret_cast<T*>(smem);
  HeadBackward<T> hb{r, a, w, workspace, lo, hi, warp_dC, warp_dC + blockDim.x / 32 * r.N, block_sum};
  const int64_t h = hb.h, p = hb.p, N = r.N, state = r.head_dim * N;
  const int64_t row = (hb.active ? p : 0) * N;
  T* S = workspace + w.block_states + h * w.block * state + row;  // this row of the state before token i
  T* dS = workspace + w.state_grad + h * state + row;
  if (hb.active) CopyRow(a.s0 ? a.s0 + h * state + row : nullptr, N, S);
  for (int64_t i = 0; i < n; ++i) {
    if (hb.active) {
      CopyRow<T>(nullptr, N, dS);
      T lambda = 1;
      const int64_t end = i + later.window < later.span ? i + later.window : later.span;
      for (int64_t t = i + 1; t < end; ++t) {
        const bool here = t < n;
        const int64_t tt = here ? t : t - n;
        lambda *= SsdStep<T>(here ? a.dt_raw : later.dt_raw, a.dt_bias, hb.A, lo, hi, r, tt, h).decay;
        const T coef = lambda * (here ? a.dy : later.dy)[r.X(tt, h) + p];
        const T* Ct = (here ? a.C : later.C) + r.BC(tt, h);
        for (int64_t j = 0; j < N; ++j) dS[j] += coef * Ct[j];
      }
    }
    hb.Token(i, S, dS);
    if (hb.active) StepRow(r, a.x, a.B, a.C, SsdStep<T>(a.dt_raw, a.dt_bias, hb.A, lo, hi, r, i, h), i, h, p, S, S);
  }
  hb.Finish();
}

}  // namespace

int64_t SsdWorkspaceElems(int64_t n, int64_t heads, int64_t head_dim, int64_t /*groups*/, int64_t N) {
  return SsdLayout(n, heads, head_dim, N).elems;
}

template <typename T>
void SsdForward(const T* x, const T* dt_raw, const T* dt_bias, const T* A_log, const T* B, const T* C, const T* D,
                const T* s0, int64_t n, int64_t heads, int64_t head_dim, int64_t groups, int64_t N, double dt_min,
                double dt_max, T* y, T* s_final) {
  const char* op = "ssd_forward";
  CheckSsdArguments(heads, groups, dt_min, dt_max, op);
  const int64_t rows = heads * head_dim;
  if (rows > 0 && N > 0) {
    T* state = static_cast<T*>(Scratch(rows * N * sizeof(T), kSlotWork0, op));
    SsdForwardKernel<T><<<Blocks(rows, kThreads), kThreads, 0, Stream()>>>(SsdRows{heads, head_dim, groups, N}, x,
                                                                           dt_raw, dt_bias, A_log, B, C, D, s0, n,
                                                                           dt_min, dt_max, state, y, s_final);
  }
  End(op);
}

// Threads and shared bytes of a backward block; refuses (before anything runs) the shapes past the kernels' limits.
template <typename T>
std::pair<int, int64_t> BackwardBlock(int64_t head_dim, int64_t N, const char* op) {
  const int threads = static_cast<int>((head_dim + 31) / 32 * 32);
  const int64_t shared = 2 * (threads / 32) * N * static_cast<int64_t>(sizeof(T));
  if (head_dim > kMaxBackwardThreads || shared > kMaxSharedBytes)
    throw CudaError(std::string(op) + ": head_dim=" + std::to_string(head_dim) + ", N=" + std::to_string(N) +
                    " exceed the CUDA kernel's limits (head_dim <= " + std::to_string(kMaxBackwardThreads) +
                    " and 2 * ceil(head_dim / 32) * N values in 48 KiB)");
  return {threads, shared};
}

template <typename T>
void SsdBackward(const T* dy, const T* ds_final, const T* x, const T* dt_raw, const T* dt_bias, const T* A_log,
                 const T* B, const T* C, const T* D, const T* s0, int64_t n, int64_t heads, int64_t head_dim,
                 int64_t groups, int64_t N, double dt_min, double dt_max, T* dx, T* ddt_raw, T* ddt_bias, T* dA_log,
                 T* dB, T* dC, T* dD, T* ds0, T* workspace) {
  const char* op = "ssd_backward";
  CheckSsdArguments(heads, groups, dt_min, dt_max, op);
  const auto [threads, shared] = BackwardBlock<T>(head_dim, N, op);
  const SsdWorkspace w = SsdLayout(n, heads, head_dim, N);
  if (heads > 0 && head_dim > 0) {
    const SsdBackwardArgs<T> args{dy, ds_final, x,  dt_raw,  dt_bias,  A_log,  B,  C,
                                  D,  s0,       dx, ddt_raw, ddt_bias, dA_log, dD, ds0};
    SsdBackwardKernel<T><<<static_cast<unsigned>(heads), threads, shared, Stream()>>>(
        SsdRows{heads, head_dim, groups, N}, w, n, dt_min, dt_max, args, workspace);
  }
  SumOverHeadGroups(workspace + w.dC_heads, n, groups, heads, N, dC);
  SumOverHeadGroups(workspace + w.dB_heads, n, groups, heads, N, dB);
  End(op);
}

template <typename T>
int64_t SsdBackwardPairs(const T* dy, const T* x, const T* dt_raw, const T* dt_bias, const T* A_log, const T* B,
                         const T* C, const T* D, const T* s0, int64_t n, int64_t heads, int64_t head_dim,
                         int64_t groups, int64_t N, double dt_min, double dt_max, const T* later_dy,
                         const T* later_dt_raw, const T* later_C, int64_t later, int64_t window, T* dx, T* ddt_raw,
                         T* ddt_bias, T* dA_log, T* dB, T* dC, T* dD, T* workspace) {
  const char* op = "ssd_backward_pairs";
  CheckSsdArguments(heads, groups, dt_min, dt_max, op);
  CheckPairsWindow(window, op);
  const auto [threads, shared] = BackwardBlock<T>(head_dim, N, op);
  window = std::min(window, n + later + 1);  // past every token left it changes nothing, and i + window stays small
  const SsdWorkspace w = SsdLayout(n, heads, head_dim, N);
  if (heads > 0 && head_dim > 0) {
    const SsdBackwardArgs<T> args{dy, nullptr, x,  dt_raw,  dt_bias,  A_log,  B,  C,
                                  D,  s0,      dx, ddt_raw, ddt_bias, dA_log, dD, nullptr};
    const SsdLater<T> after{later_dy, later_dt_raw, later_C, std::min(n + later, n - 1 + window), window};
    SsdBackwardPairsKernel<T><<<static_cast<unsigned>(heads), threads, shared, Stream()>>>(
        SsdRows{heads, head_dim, groups, N}, w, n, dt_min, dt_max, args, after, workspace);
  }
  SumOverHeadGroups(workspace + w.dC_heads, n, groups, heads, N, dC);
  SumOverHeadGroups(workspace + w.dB_heads, n, groups, heads, N, dB);
  End(op);
  return SsdPairs(n, later, window);
}

#define SG_INSTANTIATE(T)                                                                                              \
  template void SsdForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, int64_t, \
                              int64_t, int64_t, int64_t, int64_t, double, double, T*, T*);                             \
  template void SsdBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                               const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, T*,    \
                               T*, T*, T*, T*, T*, T*, T*, T*);                                                        \
  template int64_t SsdBackwardPairs<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*, \
                                       const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,          \
                                       const T*, const T*, const T*, int64_t, int64_t, T*, T*, T*, T*, T*, T*, T*,     \
                                       T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
