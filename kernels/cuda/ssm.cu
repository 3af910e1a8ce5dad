// State-space ops (Mamba-1) on CUDA: causal depthwise conv1d with a carried tail, and the selective scan (forward,
// backward, and the adjoint-sharding "pairs" backward). Same semantics as kernels/cpu/ssm.cc.
//
// Determinism: no floating-point atomics anywhere. Every output element is written by exactly one thread; sums
// over channels (dB, dC) and over time segments (dw, db) go through per-contribution scratch reduced in a fixed
// order by a second kernel, so results are bitwise reproducible run to run.
//
// Scan layout: a channel d is handled by a group of G lanes (G a power of two <= 32, inside one warp), lane l owning
// the states s = l + G*m, m < kM (kM a compile-time count of states per lane). Sums over s (y, du, ddelta) are warp
// shuffles within the group. Loops over t are sequential per lane; the parallelism is dim * G lanes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {

namespace {

constexpr int kThreads = 128;        // a multiple of 32: scan groups never straddle a warp's edge
constexpr int64_t kMaxStates = 256;  // 32 lanes x kM <= 8 states per lane

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }

// Sum of v over the aligned group of G lanes (G a power of two <= 32); every lane of the group gets it. All 32
// lanes of the warp must call it (the callers keep whole warps in step).
template <typename T>
__device__ inline T GroupSum(T v, int G) {
  for (int o = G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// True when [a, a+count) and [b, b+count) share memory (then an input must be copied before an output is written).
template <typename T>
bool Overlap(const T* a, const T* b, int64_t count) {
  if (!a || !b || count <= 0) return false;
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  const uintptr_t bytes = static_cast<uintptr_t>(count) * sizeof(T);
  return pa < pb + bytes && pb < pa + bytes;
}

// Copies count device elements into scratch `slot` and returns the copy (for inputs that alias an output).
template <typename T>
const T* CopyToScratch(const T* src, int64_t count, int slot, const char* op) {
  T* dst = static_cast<T*>(Scratch(count * sizeof(T), slot, op));
  Check(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyDeviceToDevice, Stream()), op, "copying an input");
  return dst;
}

// ---------------------------------------------------------------------------------------------------------------
// conv1d

// Row r of xx = tail[k-1] ++ x[n] for channel c (tail null = zeros).
template <typename T>
__device__ inline T ConvInput(const T* x, const T* tail, int64_t r, int64_t ch, int64_t k, int64_t c) {
  return r < k - 1 ? (tail ? tail[r * ch + c] : T(0)) : x[(r - (k - 1)) * ch + c];
}

// One thread per (t, c): consecutive threads are consecutive channels, so every load is coalesced.
template <typename T>
__global__ void Conv1dForwardKernel(const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch,
                                    int64_t k, T* y) {
  SG_CUDA_LOOP(i, n * ch) {
    const int64_t t = i / ch, c = i % ch;
    const T* wc = w + c * k;
    T acc = b ? b[c] : T(0);
    for (int64_t j = 0; j < k; ++j) acc += wc[j] * ConvInput(x, tail_in, t + j, ch, k, c);
    y[i] = acc;
  }
}

// tail_out[r][c] = xx[n + r][c]: the inputs of the last k-1 positions, the next chunk's tail_in.
template <typename T>
__global__ void Conv1dTailKernel(const T* x, const T* tail_in, int64_t n, int64_t ch, int64_t k, T* tail_out) {
  SG_CUDA_LOOP(i, (k - 1) * ch) {
    const int64_t r = i / ch, c = i % ch;
    tail_out[i] = ConvInput(x, tail_in, n + r, ch, k, c);
  }
}

// One thread per row r of xx and channel c: dxx[r] = dtail_out[r - n] (rows past x's start of the output tail) +
// sum_j w[j] dy[r - j]. Rows r < k-1 are dtail_in, the rest dx. Same summation order as the CPU (tail term first,
// then t = r - j increasing).
template <typename T>
__global__ void Conv1dDxKernel(const T* dy, const T* dtail_out, const T* w, int64_t n, int64_t ch, int64_t k, T* dx,
                               T* dtail_in) {
  SG_CUDA_LOOP(i, (n + k - 1) * ch) {
    const int64_t r = i / ch, c = i % ch;
    if (r < k - 1 && !dtail_in) continue;
    const T* wc = w + c * k;
    T acc = (r >= n && dtail_out) ? dtail_out[(r - n) * ch + c] : T(0);
    for (int64_t j = k - 1; j >= 0; --j) {
      const int64_t t = r - j;
      if (t >= 0 && t < n) acc += wc[j] * dy[t * ch + c];
    }
    if (r < k - 1)
      dtail_in[r * ch + c] = acc;
    else
      dx[(r - (k - 1)) * ch + c] = acc;
  }
}

// Partial sums of the parameter gradients over time segments [seg*L, seg*L + L): part[seg][j][c] for j < k is
// sum_t dy[t][c] xx[t+j][c] (dw), j == k is sum_t dy[t][c] (db). A second kernel adds segments in order.
template <typename T>
__global__ void Conv1dParamPartialKernel(const T* dy, const T* x, const T* tail_in, int64_t n, int64_t ch, int64_t k,
                                         int64_t segments, int64_t L, T* part) {
  SG_CUDA_LOOP(i, segments * (k + 1) * ch) {
    const int64_t c = i % ch, rest = i / ch;
    const int64_t j = rest % (k + 1), seg = rest / (k + 1);
    const int64_t t0 = seg * L, t1 = t0 + L < n ? t0 + L : n;
    T acc = 0;
    if (j < k) {
      for (int64_t t = t0; t < t1; ++t) acc += dy[t * ch + c] * ConvInput(x, tail_in, t + j, ch, k, c);
    } else {
      for (int64_t t = t0; t < t1; ++t) acc += dy[t * ch + c];
    }
    part[i] = acc;
  }
}

// dw[c][j] += sum over segments (in order), db[c] += likewise: one thread per output element, deterministic.
template <typename T>
__global__ void Conv1dParamReduceKernel(const T* part, int64_t ch, int64_t k, int64_t segments, T* dw, T* db) {
  SG_CUDA_LOOP(i, (k + 1) * ch) {
    const int64_t c = i % ch, j = i / ch;
    if (j == k && !db) continue;
    T acc = 0;
    for (int64_t seg = 0; seg < segments; ++seg) acc += part[(seg * (k + 1) + j) * ch + c];
    if (j < k)
      dw[c * k + j] += acc;
    else
      db[c] += acc;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// selective scan

// How a channel's N states spread over lanes: G lanes per channel (a power of two <= 32), M states per lane.
struct StateLanes {
  int G = 1;
  int M = 1;
};

StateLanes LanesFor(int64_t N, const char* op) {
  if (N > kMaxStates)
    throw CudaError(std::string(op) + ": state size N=" + std::to_string(N) + " exceeds the CUDA kernels' limit of " +
                    std::to_string(kMaxStates));
  StateLanes l;
  if (N <= 32) {
    while (l.G < N) l.G <<= 1;
  } else {
    l.G = 32;
    while (32 * l.M < N) l.M <<= 1;
  }
  return l;
}

// Calls f(std::integral_constant<int, M>) for the compiled states-per-lane count M (1, 2, 4, 8).
template <typename F>
void DispatchStates(int M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

// The lanes of the scan kernels: dim * G, rounded up to whole warps (idle lanes still join the shuffles).
__host__ __device__ inline int64_t PaddedLanes(int64_t dim, int G) { return (dim * G + 31) / 32 * 32; }

// Where lane i works: channel d, lane l within the channel's group, and which of its kM states exist.
#define SG_SCAN_LANE(i, dim, N, G, kM)                       \
  const bool active = (i) < (dim) * (G);                      \
  const int64_t d = active ? (i) / (G) : 0;                   \
  const int l = static_cast<int>((i) % (G));                  \
  bool on[kM];                                                \
  _Pragma("unroll") for (int m = 0; m < kM; ++m) on[m] = active && l + (G) * m < (N)

// Forward recurrence per (channel, state): h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t . h_t + D u_t.
// y, h_final, hs may each be null; hs[t][d][s] receives every h_t (the backward's saved states).
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads)
    ScanForwardKernel(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D, const T* h0,
                      int64_t n, int64_t dim, int64_t N, int G, T* y, T* h_final, T* hs) {
  SG_CUDA_LOOP(i, PaddedLanes(dim, G)) {
    SG_SCAN_LANE(i, dim, N, G, kM);
    T a[kM], h[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int64_t s = l + G * m;
      a[m] = on[m] ? A[d * N + s] : T(0);
      h[m] = on[m] && h0 ? h0[d * N + s] : T(0);
    }
    const T Dd = active && D ? D[d] : T(0);
    for (int64_t t = 0; t < n; ++t) {
      const T dt = active ? delta[t * dim + d] : T(0), ut = active ? u[t * dim + d] : T(0);
      T acc = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (!on[m]) continue;
        const int64_t s = l + G * m;
        h[m] = Exp(dt * a[m]) * h[m] + dt * B[t * N + s] * ut;
        acc += C[t * N + s] * h[m];
        if (hs) hs[(t * dim + d) * N + s] = h[m];
      }
      acc = GroupSum(acc, G);
      if (y && active && l == 0) y[t * dim + d] = acc + Dd * ut;
    }
    if (h_final) {
#pragma unroll
      for (int m = 0; m < kM; ++m)
        if (on[m]) h_final[d * N + l + G * m] = h[m];
    }
  }
}

// out[t][s] = sum_d weight[t][d] * part[t][d][s] (weight null = 1), d in order: the deterministic sum over channels
// behind dB and dC.
template <typename T>
__global__ void SumOverChannelsKernel(const T* part, const T* weight, int64_t n, int64_t dim, int64_t N, T* out) {
  SG_CUDA_LOOP(i, n * N) {
    const int64_t t = i / N, s = i % N;
    const T* p = part + t * dim * N + s;
    T acc = 0;
    if (weight) {
      const T* wt = weight + t * dim;
      for (int64_t d = 0; d < dim; ++d) acc += wt[d] * p[d * N];
    } else {
      for (int64_t d = 0; d < dim; ++d) acc += p[d * N];
    }
    out[i] = acc;
  }
}

// Reverse sweep per (channel, state) with the state cotangent g (from dh_final): at step t, g += dy_t C_t, then the
// VJP of h_t = e h_{t-1} + delta_t B_t u_t, e = exp(delta_t A), and g *= e. hs holds the forward states h_t on entry;
// slot t is overwritten with the dB contribution g delta_t u_t once h_t is no longer needed (dC was reduced from
// the states before this kernel), and SumOverChannelsKernel sums them over d afterwards.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads)
    ScanBackwardKernel(const T* dy, const T* dh_final, const T* u, const T* delta, const T* A, const T* B,
                       const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, int G, T* hs, T* du,
                       T* ddelta, T* dA, T* dD, T* dh0, const T* C) {
  SG_CUDA_LOOP(i, PaddedLanes(dim, G)) {
    SG_SCAN_LANE(i, dim, N, G, kM);
    T a[kM], g[kM], dAl[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int64_t s = l + G * m;
      a[m] = on[m] ? A[d * N + s] : T(0);
      g[m] = on[m] && dh_final ? dh_final[d * N + s] : T(0);
      dAl[m] = 0;
    }
    const T Dd = active && D ? D[d] : T(0);
    T dDd = 0;
    for (int64_t t = n - 1; t >= 0; --t) {
      const T dt = active ? delta[t * dim + d] : T(0), ut = active ? u[t * dim + d] : T(0);
      const T gy = active ? dy[t * dim + d] : T(0);
      T du_t = 0, ddt = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (!on[m]) continue;
        const int64_t s = l + G * m;
        const T prev = t > 0 ? hs[((t - 1) * dim + d) * N + s] : (h0 ? h0[d * N + s] : T(0));
        const T e = Exp(dt * a[m]);
        const T Bs = B[t * N + s];
        g[m] += gy * C[t * N + s];
        hs[(t * dim + d) * N + s] = g[m] * dt * ut;
        du_t += g[m] * dt * Bs;
        ddt += g[m] * (Bs * ut + a[m] * e * prev);
        dAl[m] += g[m] * dt * e * prev;
        g[m] *= e;
      }
      du_t = GroupSum(du_t, G);
      ddt = GroupSum(ddt, G);
      if (active && l == 0) {
        du[t * dim + d] = Dd * gy + du_t;
        ddelta[t * dim + d] = ddt;
        dDd += gy * ut;
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      if (!on[m]) continue;
      const int64_t s = l + G * m;
      dA[d * N + s] += dAl[m];
      if (dh0) dh0[d * N + s] = g[m];
    }
    if (dD && active && l == 0) dD[d] += dDd;
  }
}

// Adjoint sharding per (channel, state), the same math as the CPU's SelectiveScanBackwardPairs: walking positions
// i forward (recomputing h_{i-1} -> h_i), dh_i = sum_{t=i}^{end_i - 1} dy_t C_t prod_{i<j<=t} exp(delta_j A) with
// end_i = min(span, i + window), the product built one factor at a time from t = i (as the CPU does); positions
// t >= n read later_*. Then the VJP of step i with cotangent dh_i. A direct O(n * window) loop per lane: exact and
// simple rather than fast. part[i][d][s] receives the dB contributions dh_i delta_i u_i (summed over d afterwards).
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads)
    ScanPairsKernel(const T* dy, const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D,
                    const T* h0, int64_t n, int64_t dim, int64_t N, const T* later_dy, const T* later_delta,
                    const T* later_C, int64_t span, int64_t window, int G, T* part, T* du, T* ddelta, T* dA, T* dD) {
  SG_CUDA_LOOP(i_lane, PaddedLanes(dim, G)) {
    SG_SCAN_LANE(i_lane, dim, N, G, kM);
    T a[kM], h[kM], dAl[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int64_t s = l + G * m;
      a[m] = on[m] ? A[d * N + s] : T(0);
      h[m] = on[m] && h0 ? h0[d * N + s] : T(0);
      dAl[m] = 0;
    }
    const T Dd = active && D ? D[d] : T(0);
    T dDd = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T dti = active ? delta[i * dim + d] : T(0), ui = active ? u[i * dim + d] : T(0);
      const T gi = active ? dy[i * dim + d] : T(0);
      T prev[kM], ei[kM], p[kM], q[kM];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int64_t s = l + G * m;
        prev[m] = h[m];
        ei[m] = on[m] ? Exp(dti * a[m]) : T(0);
        if (on[m]) h[m] = ei[m] * h[m] + dti * B[i * N + s] * ui;
        p[m] = T(1);                                // lambda^{i,i} = C_i
        q[m] = on[m] ? gi * C[i * N + s] : T(0);  // the pair (i, i)
      }
      // The pairs (t, i), i < t < end: the decay product picks up exp(delta_t A), and dy_t C_t (product) joins dh_i.
      const int64_t end = i + window < span ? i + window : span;
      for (int64_t t = i + 1; t < end; ++t) {
        const bool here = t < n;
        const T gt = active ? (here ? dy[t * dim + d] : later_dy[(t - n) * dim + d]) : T(0);
        const T dtt = active ? (here ? delta[t * dim + d] : later_delta[(t - n) * dim + d]) : T(0);
        const T* Ct = here ? C + t * N : later_C + (t - n) * N;
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          if (!on[m]) continue;
          p[m] *= Exp(dtt * a[m]);
          q[m] += gt * Ct[l + G * m] * p[m];
        }
      }
      // The VJP of step i with cotangent dh_i = q: h_i = exp(delta_i A) h_{i-1} + delta_i B_i u_i.
      T du_i = 0, ddt = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (!on[m]) continue;
        const int64_t s = l + G * m;
        const T Bs = B[i * N + s];
        part[(i * dim + d) * N + s] = q[m] * dti * ui;
        du_i += q[m] * dti * Bs;
        ddt += q[m] * (Bs * ui + a[m] * ei[m] * prev[m]);
        dAl[m] += q[m] * dti * ei[m] * prev[m];
      }
      du_i = GroupSum(du_i, G);
      ddt = GroupSum(ddt, G);
      if (active && l == 0) {
        du[i * dim + d] = Dd * gi + du_i;
        ddelta[i * dim + d] = ddt;
        dDd += gi * ui;
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m)
      if (on[m]) dA[d * N + l + G * m] += dAl[m];
    if (dD && active && l == 0) dD[d] += dDd;
  }
}

#undef SG_SCAN_LANE

// Launches the forward scan (any of y, h_final, hs may be null).
template <typename T>
void LaunchScanForward(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D, const T* h0,
                       int64_t n, int64_t dim, int64_t N, T* y, T* h_final, T* hs, const char* op) {
  const StateLanes lanes = LanesFor(N, op);
  const unsigned blocks = Blocks(PaddedLanes(dim, lanes.G), kThreads);
  DispatchStates(lanes.M, [&](auto m) {
    ScanForwardKernel<T, decltype(m)::value>
        <<<blocks, kThreads, 0, Stream()>>>(u, delta, A, B, C, D, h0, n, dim, N, lanes.G, y, h_final, hs);
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The table's entry points.

template <typename T>
void Conv1dForward(const T* x, const T* tail_in, const T* w, const T* b, int64_t n, int64_t ch, int64_t k, T* y,
                   T* tail_out) {
  const char* op = "conv1d_forward";
  const int64_t tail = (k - 1) * ch;
  if (n * ch > 0)
    Conv1dForwardKernel<T><<<Blocks(n * ch, 256), 256, 0, Stream()>>>(x, tail_in, w, b, n, ch, k, y);
  if (tail_out && tail > 0) {
    // A chunk shorter than the tail carries part of tail_in over; if tail_out is tail_in's buffer, read a copy.
    const T* tin = Overlap(tail_in, static_cast<const T*>(tail_out), tail)
                       ? CopyToScratch(tail_in, tail, kSlotWork0, op)
                       : tail_in;
    Conv1dTailKernel<T><<<Blocks(tail, 256), 256, 0, Stream()>>>(x, tin, n, ch, k, tail_out);
  }
  End(op);
}

template <typename T>
void Conv1dBackward(const T* dy, const T* dtail_out, const T* x, const T* tail_in, const T* w, int64_t n, int64_t ch,
                    int64_t k, T* dx, T* dtail_in, T* dw, T* db) {
  const char* op = "conv1d_backward";
  const int64_t tail = (k - 1) * ch;
  // dtail_in may share dtail_out's buffer: then read dtail_out from a copy (other threads write dtail_in).
  if (Overlap(dtail_out, static_cast<const T*>(dtail_in), tail))
    dtail_out = CopyToScratch(dtail_out, tail, kSlotWork2, op);
  if ((n + k - 1) * ch > 0)
    Conv1dDxKernel<T><<<Blocks((n + k - 1) * ch, 256), 256, 0, Stream()>>>(dy, dtail_out, w, n, ch, k, dx, dtail_in);
  if (n > 0 && ch > 0 && k > 0) {
    // Split t into segments so that about 64K threads share the sums; the segments are added in order.
    const int64_t per_segment = (k + 1) * ch;
    int64_t segments = std::max<int64_t>(1, std::min<int64_t>(n, (65536 + per_segment - 1) / per_segment));
    const int64_t L = (n + segments - 1) / segments;
    segments = (n + L - 1) / L;
    T* part = static_cast<T*>(Scratch(segments * per_segment * sizeof(T), kSlotWork0, op));
    Conv1dParamPartialKernel<T><<<Blocks(segments * per_segment, 256), 256, 0, Stream()>>>(dy, x, tail_in, n, ch, k,
                                                                                          segments, L, part);
    Conv1dParamReduceKernel<T><<<Blocks(per_segment, 256), 256, 0, Stream()>>>(part, ch, k, segments, dw, db);
  }
  End(op);
}

template <typename T>
void SelectiveScanForward(const T* u, const T* delta, const T* A, const T* B, const T* C, const T* D, const T* h0,
                          int64_t n, int64_t dim, int64_t N, T* y, T* h_final) {
  const char* op = "selective_scan_forward";
  if (dim > 0) LaunchScanForward<T>(u, delta, A, B, C, D, h0, n, dim, N, y, h_final, nullptr, op);
  End(op);
}

template <typename T>
void SelectiveScanBackward(const T* dy, const T* dh_final, const T* u, const T* delta, const T* A, const T* B,
                           const T* C, const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, T* du, T* ddelta,
                           T* dA, T* dB, T* dC, T* dD, T* dh0) {
  const char* op = "selective_scan_backward";
  const StateLanes lanes = LanesFor(N, op);
  if (dim <= 0) {
    // No channels: the sums over channels are empty.
    if (n * N > 0) {
      Check(cudaMemsetAsync(dB, 0, n * N * sizeof(T), Stream()), op, "zeroing dB");
      Check(cudaMemsetAsync(dC, 0, n * N * sizeof(T), Stream()), op, "zeroing dC");
    }
    End(op);
    return;
  }
  // The states h_t [n][dim][N], recomputed from h0; later reused in place for the dB contributions.
  T* hs = static_cast<T*>(Scratch(std::max<int64_t>(1, n * dim * N) * sizeof(T), kSlotWork0, op));
  LaunchScanForward<T>(u, delta, A, B, C, D, h0, n, dim, N, nullptr, nullptr, hs, op);
  // dC[t][s] = sum_d dy[t][d] h_t[d][s] needs only the states: reduce it before the sweep overwrites them.
  if (n * N > 0) SumOverChannelsKernel<T><<<Blocks(n * N, 256), 256, 0, Stream()>>>(hs, dy, n, dim, N, dC);
  const unsigned blocks = Blocks(PaddedLanes(dim, lanes.G), kThreads);
  DispatchStates(lanes.M, [&](auto m) {
    ScanBackwardKernel<T, decltype(m)::value><<<blocks, kThreads, 0, Stream()>>>(
        dy, dh_final, u, delta, A, B, D, h0, n, dim, N, lanes.G, hs, du, ddelta, dA, dD, dh0, C);
  });
  if (n * N > 0) SumOverChannelsKernel<T><<<Blocks(n * N, 256), 256, 0, Stream()>>>(hs, nullptr, n, dim, N, dB);
  End(op);
}

template <typename T>
int64_t SelectiveScanBackwardPairs(const T* dy, const T* u, const T* delta, const T* A, const T* B, const T* C,
                                   const T* D, const T* h0, int64_t n, int64_t dim, int64_t N, const T* later_dy,
                                   const T* later_delta, const T* later_C, int64_t later, int64_t window, T* du,
                                   T* ddelta, T* dA, T* dB, T* dC, T* dD) {
  const char* op = "selective_scan_backward_pairs";
  const StateLanes lanes = LanesFor(N, op);
  // A window past every token left changes nothing (end_i = span either way); clamping it keeps i + window from
  // overflowing for "unbounded" windows.
  window = std::min(window, n + later + 1);
  const int64_t span = std::min(n + later, n - 1 + window);  // positions any pair of this chunk reads
  int64_t pairs = 0;
  for (int64_t i = 0; i < n; ++i) pairs += std::min(span, i + window) - i;
  if (n <= 0) {
    End(op);
    return pairs;
  }
  if (dim <= 0) {
    if (N > 0) {
      Check(cudaMemsetAsync(dB, 0, n * N * sizeof(T), Stream()), op, "zeroing dB");
      Check(cudaMemsetAsync(dC, 0, n * N * sizeof(T), Stream()), op, "zeroing dC");
    }
    End(op);
    return pairs;
  }
  // Per-(position, channel, state) contributions [n][dim][N]: first the states (for dC), then the dB terms.
  T* part = static_cast<T*>(Scratch(std::max<int64_t>(1, n * dim * N) * sizeof(T), kSlotWork0, op));
  LaunchScanForward<T>(u, delta, A, B, C, D, h0, n, dim, N, nullptr, nullptr, part, op);
  // The C term is local: y_i reads h_i only, so dC[i][s] = sum_d dy[i][d] h_i[d][s].
  if (N > 0) SumOverChannelsKernel<T><<<Blocks(n * N, 256), 256, 0, Stream()>>>(part, dy, n, dim, N, dC);
  const unsigned blocks = Blocks(PaddedLanes(dim, lanes.G), kThreads);
  DispatchStates(lanes.M, [&](auto m) {
    ScanPairsKernel<T, decltype(m)::value><<<blocks, kThreads, 0, Stream()>>>(
        dy, u, delta, A, B, C, D, h0, n, dim, N, later_dy, later_delta, later_C, span, window, lanes.G, part, du,
        ddelta, dA, dD);
  });
  if (N > 0) SumOverChannelsKernel<T><<<Blocks(n * N, 256), 256, 0, Stream()>>>(part, nullptr, n, dim, N, dB);
  End(op);
  return pairs;
}

#define SG_INSTANTIATE(T)                                                                                        \
  template void Conv1dForward<T>(const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, T*);     \
  template void Conv1dBackward<T>(const T*, const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,   \
                                  T*, T*, T*, T*);                                                               \
  template void SelectiveScanForward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*,    \
                                        int64_t, int64_t, int64_t, T*, T*);                                      \
  template void SelectiveScanBackward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*,   \
                                         const T*, const T*, int64_t, int64_t, int64_t, T*, T*, T*, T*, T*, T*,  \
                                         T*);                                                                    \
  template int64_t SelectiveScanBackwardPairs<T>(const T*, const T*, const T*, const T*, const T*, const T*,     \
                                                 const T*, const T*, int64_t, int64_t, int64_t, const T*,        \
                                                 const T*, const T*, int64_t, int64_t, T*, T*, T*, T*, T*, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cuda
