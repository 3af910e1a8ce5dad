// Flash-style causal GQA attention over a paged KV cache, forward and backward (same semantics as
// kernels/cpu/attention.cc).
//
// Tiling: a block of 256 threads is a 16 x 16 grid (ty, tx). Query and key tiles have TILE rows (64, or 32/16 for
// wide heads and doubles so that shared memory fits); Q/K/V/dO tiles live in shared memory as [TILE][HD + 1]
// (padded: column reads are conflict free), head_dim zero-padded up to HD in {16, 32, 64, 128, 256}. Each thread
// owns the scores of rows ty + 16x and columns tx + 16y of a TILE x TILE score tile, and the output rows
// ty + 16x, dims tx + 16d of its accumulator, both in registers. A key tile is TILE consecutive logical positions,
// the first tile starting at key_begin (packed documents: keys of earlier documents are neither loaded nor
// computed); every key row finds its own page (so tiny pages cost nothing extra), and rows of unselected pages are
// masked.
//
// Forward: block = (query tile, head); online softmax over key tiles, saves lse = m + log(l).
// Backward: D = rowsum(dO * O) (one warp per row and head, into the workspace); then
//   dK/dV: block = (key tile, kv head g) loops over every query row of every head of group g that sees the tile,
//          recomputes P = exp(S - lse), dS = P (dP - D), accumulates dV += P^T dO, dK += scale dS^T Q in registers
//          and adds them once into the gradient pages;
//   dQ:    block = (query tile, head) loops over key tiles, dQ = scale sum dS K, assigned.
// Deterministic, no atomics: every element of dQ, dK and dV has exactly one writer thread in one block, and that
// thread sums its terms in a fixed order (query tiles / key tiles in increasing order), so the result does not
// depend on scheduling.
//
// Rows that see no selected key at all get out = 0, lse = -inf and zero gradients (the CPU divides 0 by 0 there).
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"

namespace sg::cuda {
namespace {

constexpr int kThreads = 256;  // 16 x 16

// Shared memory of the largest kernel (dK/dV: K, V, Q, dO tiles, P and dS tiles, three row-offset arrays).
constexpr size_t BackwardBytes(int tile, int hd, size_t elem) {
  return (size_t(4) * tile * (hd + 1) + size_t(2) * tile * (tile + 1)) * elem + 3 * tile * sizeof(int64_t);
}
// Tile rows per (T, HD): 64 while the backward fits in 99 KiB (two blocks per SM, any sm_80+ GPU), else 32 while
// it fits in 144 KiB (H100/A100), else 16 (double with head_dim > 64).
template <typename T, int HD>
constexpr int TileRows() {
  return BackwardBytes(64, HD, sizeof(T)) <= 99 * 1024 ? 64 : BackwardBytes(32, HD, sizeof(T)) <= 144 * 1024 ? 32 : 16;
}

template <typename T, int HD>
struct Cfg {
  static constexpr int kTile = TileRows<T, HD>();
  static constexpr int kM = kTile / 16;  // score rows (and columns) per thread
  static constexpr int kD = HD / 16;     // head-dim columns per thread
  static constexpr int kLd = HD + 1;     // padded row stride of Q/K/V/dO tiles
  static constexpr int kLdS = kTile + 1;  // padded row stride of P/dS tiles
  // Dynamic shared memory: `tiles` row tiles, `stiles` score tiles and three row-offset arrays.
  static constexpr size_t Bytes(int tiles, int stiles) {
    return (size_t(tiles) * kTile * kLd + size_t(stiles) * kTile * kLdS) * sizeof(T) + 3 * kTile * sizeof(int64_t);
  }
  static_assert(Bytes(4, 2) == BackwardBytes(kTile, HD, sizeof(T)), "tile choice and kernels disagree");
};

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Log(float x) { return logf(x); }
__device__ inline double Log(double x) { return log(x); }

// dst[r][d] = src[off[r] + d] for d < hd; zero for padded dims and rows with off[r] < 0 (masked or absent rows).
template <int HD, int TILE, typename T>
__device__ inline void LoadRows(T* dst, const T* src, const int64_t* off, int64_t hd) {
  for (int idx = threadIdx.x; idx < TILE * HD; idx += kThreads) {
    const int r = idx / HD, d = idx % HD;
    const int64_t o = off[r];
    dst[r * (HD + 1) + d] = (o >= 0 && d < hd) ? src[o + d] : T(0);
  }
}

// s[x][y] = A[ty + 16x] . B[tx + 16y] over the (zero-padded) head dim.
template <int HD, int M, typename T>
__device__ inline void TileDot(const T* A, const T* B, int ty, int tx, T (&s)[M][M]) {
#pragma unroll
  for (int x = 0; x < M; ++x)
#pragma unroll
    for (int y = 0; y < M; ++y) s[x][y] = 0;
#pragma unroll 4
  for (int k = 0; k < HD; ++k) {
    T av[M], bv[M];
#pragma unroll
    for (int x = 0; x < M; ++x) av[x] = A[(ty + 16 * x) * (HD + 1) + k];
#pragma unroll
    for (int y = 0; y < M; ++y) bv[y] = B[(tx + 16 * y) * (HD + 1) + k];
#pragma unroll
    for (int x = 0; x < M; ++x)
#pragma unroll
      for (int y = 0; y < M; ++y) s[x][y] += av[x] * bv[y];
  }
}

// acc[x][d] += sum_c S(ty + 16x, c) * B[c][tx + 16d], S(r, c) at S[r * RS + c * CS] (CS = 1: P V and dS K;
// RS = 1: the transposed P^T dO and dS^T Q of the dK/dV kernel).
template <int HD, int TL, int RS, int CS, int M, int ND, typename T>
__device__ inline void MulAcc(const T* S, const T* B, int ty, int tx, T (&acc)[M][ND]) {
#pragma unroll 4
  for (int c = 0; c < TL; ++c) {
    T sv[M];
#pragma unroll
    for (int x = 0; x < M; ++x) sv[x] = S[(ty + 16 * x) * RS + c * CS];
#pragma unroll
    for (int d = 0; d < ND; ++d) {
      const T b = B[c * (HD + 1) + tx + 16 * d];
#pragma unroll
      for (int x = 0; x < M; ++x) acc[x][d] += sv[x] * b;
    }
  }
}

// The thread's part of a score tile, registers -> shared [TL][LDS].
template <int LDS, int M, typename T>
__device__ inline void StoreScores(T* dst, const T (&s)[M][M], int ty, int tx) {
#pragma unroll
  for (int x = 0; x < M; ++x)
#pragma unroll
    for (int y = 0; y < M; ++y) dst[(ty + 16 * x) * LDS + tx + 16 * y] = s[x][y];
}

template <int M, int ND, typename T>
__device__ inline void Zero(T (&acc)[M][ND]) {
#pragma unroll
  for (int x = 0; x < M; ++x)
#pragma unroll
    for (int d = 0; d < ND; ++d) acc[x][d] = 0;
}

// Reductions over the 16 threads (tx) that share a score row: offsets < 16 stay within a half warp.
template <typename T>
__device__ inline T RowMax16(T v) {
  for (int o = 8; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T>
__device__ inline T RowSum16(T v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Fills the query-row offsets of rows [i0, i0 + TILE) of head h (-1 past the chunk).
template <int TILE, typename T>
__device__ inline void QueryOffsets(const Args<T>& a, int64_t i0, int h, int64_t* qoff) {
  for (int r = threadIdx.x; r < TILE; r += kThreads)
    qoff[r] = i0 + r < a.n ? (i0 + r) * a.heads * a.hd + h * a.hd : -1;
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads) ForwardKernel(Args<T> a, const T* q, T* out, T* lse) {
  using C = Cfg<T, HD>;
  constexpr int TL = C::kTile, M = C::kM, ND = C::kD, LD = C::kLd, LDS = C::kLdS;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sKV = sQ + TL * LD;  // K, then V of the current key tile
  T* sP = sKV + TL * LD;
  int64_t* qoff = reinterpret_cast<int64_t*>(sP + TL * LDS);
  int64_t* koff = qoff + TL;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int h = blockIdx.y, g = h / a.group;
  const int64_t i0 = int64_t(blockIdx.x) * TL;
  const int rows = static_cast<int>(Min64(TL, a.n - i0));
  QueryOffsets<TL>(a, i0, h, qoff);
  __syncthreads();
  LoadRows<HD, TL>(sQ, q, qoff, a.hd);

  const T neg_inf = -INFINITY;
  T m[M], l[M], o[M][ND];
  Zero(o);
#pragma unroll
  for (int x = 0; x < M; ++x) {
    m[x] = neg_inf;
    l[x] = 0;
  }
  const int64_t kv_end = a.pos0 + i0 + rows;  // the last row of the tile sees keys [key_begin, kv_end)
  for (int64_t j0 = a.key_begin; j0 < kv_end; j0 += TL) {
    bool any = false;
    for (int c = threadIdx.x; c < TL; c += kThreads) {
      koff[c] = KeyOffset(a, j0 + c, g);
      any |= koff[c] >= 0;
    }
    if (!__syncthreads_or(any)) continue;  // the whole tile lies in unselected pages
    LoadRows<HD, TL>(sKV, a.k_pool, koff, a.hd);
    __syncthreads();
    T s[M][M];
    TileDot<HD>(sQ, sKV, ty, tx, s);
    // Causal + page mask, then the online softmax update of each row (its 16 threads agree on m and l).
#pragma unroll
    for (int x = 0; x < M; ++x) {
      const int r = ty + 16 * x;
      const int64_t qpos = a.pos0 + i0 + r;
      T mx = neg_inf;
#pragma unroll
      for (int y = 0; y < M; ++y) {
        const int c = tx + 16 * y;
        const bool ok = r < rows && koff[c] >= 0 && j0 + c <= qpos;
        s[x][y] = ok ? s[x][y] * a.scale : neg_inf;
        mx = max(mx, s[x][y]);
      }
      const T m_new = max(m[x], RowMax16(mx));
      const T alpha = m_new == neg_inf ? T(1) : Exp(m[x] - m_new);  // no key yet: nothing to rescale
      T sum = 0;
#pragma unroll
      for (int y = 0; y < M; ++y) {
        s[x][y] = s[x][y] == neg_inf ? T(0) : Exp(s[x][y] - m_new);
        sum += s[x][y];
      }
      l[x] = l[x] * alpha + RowSum16(sum);
      m[x] = m_new;
#pragma unroll
      for (int d = 0; d < ND; ++d) o[x][d] *= alpha;
    }
    __syncthreads();  // everyone is done with K
    StoreScores<LDS>(sP, s, ty, tx);
    LoadRows<HD, TL>(sKV, a.v_pool, koff, a.hd);
    __syncthreads();
    MulAcc<HD, TL, LDS, 1>(sP, sKV, ty, tx, o);  // O += P V
    __syncthreads();  // before the next tile overwrites koff, sKV, sP
  }
#pragma unroll
  for (int x = 0; x < M; ++x) {
    const int r = ty + 16 * x;
    if (r >= rows) continue;
    const T inv = l[x] > 0 ? T(1) / l[x] : T(0);
#pragma unroll
    for (int d = 0; d < ND; ++d)
      if (tx + 16 * d < a.hd) out[qoff[r] + tx + 16 * d] = o[x][d] * inv;
    if (tx == 0) lse[h * a.n + i0 + r] = l[x] > 0 ? m[x] + Log(l[x]) : neg_inf;
  }
}

// Recomputes P (masked, exp(S - lse)) and dS = P (dP - D) for a query tile x key tile; returns both in registers.
template <typename T, int HD, int M>
__device__ inline void ScoresBackward(const Args<T>& a, const T* sQ, const T* sdO, const T* sK, const T* sV,
                                      const int64_t* koff, int64_t i0, int rows, int64_t j0, const T (&lr)[M],
                                      const T (&dr)[M], T (&p)[M][M], T (&ds)[M][M]) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  TileDot<HD>(sQ, sK, ty, tx, p);
  TileDot<HD>(sdO, sV, ty, tx, ds);  // dP
#pragma unroll
  for (int x = 0; x < M; ++x) {
    const int r = ty + 16 * x;
    const int64_t qpos = a.pos0 + i0 + r;
#pragma unroll
    for (int y = 0; y < M; ++y) {
      const int c = tx + 16 * y;
      const bool ok = r < rows && koff[c] >= 0 && j0 + c <= qpos && lr[x] != T(-INFINITY);
      p[x][y] = ok ? Exp(p[x][y] * a.scale - lr[x]) : T(0);
      ds[x][y] = p[x][y] * (ds[x][y] - dr[x]);
    }
  }
}

// Loads lse and D of the thread's score rows (zero past the chunk).
template <typename T, int M>
__device__ inline void RowStats(const Args<T>& a, const T* lse, const T* D, int h, int64_t i0, int rows, T (&lr)[M],
                                T (&dr)[M]) {
  const int ty = threadIdx.x / 16;
#pragma unroll
  for (int x = 0; x < M; ++x) {
    const int r = ty + 16 * x;
    lr[x] = r < rows ? lse[h * a.n + i0 + r] : T(0);
    dr[x] = r < rows ? D[h * a.n + i0 + r] : T(0);
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
    DqKernel(Args<T> a, const T* q, const T* dout, const T* lse, const T* D, T* dq) {
  using C = Cfg<T, HD>;
  constexpr int TL = C::kTile, M = C::kM, ND = C::kD, LD = C::kLd, LDS = C::kLdS;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + TL * LD;
  T* sK = sdO + TL * LD;
  T* sV = sK + TL * LD;
  T* sS = sV + TL * LD;
  int64_t* qoff = reinterpret_cast<int64_t*>(sS + TL * LDS);
  int64_t* koff = qoff + TL;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int h = blockIdx.y, g = h / a.group;
  const int64_t i0 = int64_t(blockIdx.x) * TL;
  const int rows = static_cast<int>(Min64(TL, a.n - i0));
  QueryOffsets<TL>(a, i0, h, qoff);
  __syncthreads();
  LoadRows<HD, TL>(sQ, q, qoff, a.hd);
  LoadRows<HD, TL>(sdO, dout, qoff, a.hd);
  T lr[M], dr[M];
  RowStats(a, lse, D, h, i0, rows, lr, dr);
  T acc[M][ND];
  Zero(acc);

  const int64_t kv_end = a.pos0 + i0 + rows;
  for (int64_t j0 = a.key_begin; j0 < kv_end; j0 += TL) {
    bool any = false;
    for (int c = threadIdx.x; c < TL; c += kThreads) {
      koff[c] = KeyOffset(a, j0 + c, g);
      any |= koff[c] >= 0;
    }
    if (!__syncthreads_or(any)) continue;
    LoadRows<HD, TL>(sK, a.k_pool, koff, a.hd);
    LoadRows<HD, TL>(sV, a.v_pool, koff, a.hd);
    __syncthreads();
    T p[M][M], ds[M][M];
    ScoresBackward<T, HD, M>(a, sQ, sdO, sK, sV, koff, i0, rows, j0, lr, dr, p, ds);
    StoreScores<LDS>(sS, ds, ty, tx);
    __syncthreads();
    MulAcc<HD, TL, LDS, 1>(sS, sK, ty, tx, acc);  // dQ += dS K (scaled once at the end)
    __syncthreads();
  }
#pragma unroll
  for (int x = 0; x < M; ++x) {
    const int r = ty + 16 * x;
    if (r >= rows) continue;
#pragma unroll
    for (int d = 0; d < ND; ++d)
      if (tx + 16 * d < a.hd) dq[qoff[r] + tx + 16 * d] = acc[x][d] * a.scale;
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
    DkdvKernel(Args<T> a, const T* q, const T* dout, const T* lse, const T* D, T* dk_pool, T* dv_pool,
               const int32_t* gtable, int64_t gstride) {
  using C = Cfg<T, HD>;
  constexpr int TL = C::kTile, M = C::kM, ND = C::kD, LD = C::kLd, LDS = C::kLdS;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + TL * LD;
  T* sQ = sV + TL * LD;
  T* sdO = sQ + TL * LD;
  T* sP = sdO + TL * LD;
  T* sS = sP + TL * LDS;
  int64_t* koff = reinterpret_cast<int64_t*>(sS + TL * LDS);
  int64_t* goff = koff + TL;  // gradient row offset, -1 = no gradient wanted (or key masked)
  int64_t* qoff = goff + TL;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int g = blockIdx.y;
  const int64_t j0 = a.key_begin + int64_t(blockIdx.x) * TL;
  bool any = false;
  for (int c = threadIdx.x; c < TL; c += kThreads) {
    koff[c] = KeyOffset(a, j0 + c, g);
    goff[c] = GradOffset(a, j0 + c, g, koff[c], gtable, gstride);
    any |= goff[c] >= 0;
  }
  if (!__syncthreads_or(any)) return;  // no key of this tile wants a gradient
  LoadRows<HD, TL>(sK, a.k_pool, koff, a.hd);
  LoadRows<HD, TL>(sV, a.v_pool, koff, a.hd);
  T dk[M][ND], dv[M][ND];  // rows: keys ty + 16x; columns: dims tx + 16d
  Zero(dk);
  Zero(dv);

  // Query i sees key j iff j <= pos0 + i: the first query row that sees this tile is j0 - pos0.
  const int64_t first = Max64(0, j0 - a.pos0);
  for (int64_t h = int64_t(g) * a.group; h < (g + 1) * a.group; ++h) {
    for (int64_t i0 = first; i0 < a.n; i0 += TL) {
      const int rows = static_cast<int>(Min64(TL, a.n - i0));
      QueryOffsets<TL>(a, i0, static_cast<int>(h), qoff);
      __syncthreads();
      LoadRows<HD, TL>(sQ, q, qoff, a.hd);
      LoadRows<HD, TL>(sdO, dout, qoff, a.hd);
      T lr[M], dr[M];
      RowStats(a, lse, D, static_cast<int>(h), i0, rows, lr, dr);
      __syncthreads();
      T p[M][M], ds[M][M];
      ScoresBackward<T, HD, M>(a, sQ, sdO, sK, sV, koff, i0, rows, j0, lr, dr, p, ds);
      StoreScores<LDS>(sP, p, ty, tx);
      StoreScores<LDS>(sS, ds, ty, tx);
      __syncthreads();
      MulAcc<HD, TL, 1, LDS>(sP, sdO, ty, tx, dv);  // dV += P^T dO
      MulAcc<HD, TL, 1, LDS>(sS, sQ, ty, tx, dk);   // dK += dS^T Q (scaled once at the end)
      __syncthreads();  // before the next query tile overwrites qoff, sQ, sdO, sP, sS
    }
  }
  // One read-modify-write per element: the only writer of these gradient rows.
#pragma unroll
  for (int x = 0; x < M; ++x) {
    const int64_t go = goff[ty + 16 * x];
    if (go < 0) continue;
#pragma unroll
    for (int d = 0; d < ND; ++d) {
      const int dd = tx + 16 * d;
      if (dd >= a.hd) continue;
      dk_pool[go + dd] += dk[x][d] * a.scale;
      dv_pool[go + dd] += dv[x][d];
    }
  }
}

}  // namespace

int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t /*page_size*/) {
  return s.n * s.heads;  // D = rowsum(dO * O) of the backward, [heads][n]
}

template <typename T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse, T* /*workspace*/) {
  const char* op = "attention_forward";
  if (s.n > 0) {
    const Args<T> a = MakeArgs<T>(s, kv, op);
    DispatchHeadDim(s.head_dim, op, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      using C = Cfg<T, HD>;
      const size_t bytes = SharedMemory(ForwardKernel<T, HD>, C::Bytes(2, 1), op);
      const dim3 grid(Tiles(s.n, C::kTile), static_cast<unsigned>(s.heads));
      ForwardKernel<T, HD><<<grid, kThreads, bytes, Stream()>>>(a, q, out, lse);
    });
  }
  End(op);
}

template <typename T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<T>& dkv, T* workspace) {
  const char* op = "attention_backward";
  if (s.n > 0) {
    const Args<T> a = MakeArgs<T>(s, kv, op);
    const int64_t pages = (a.kv_total + kv.page_size - 1) / kv.page_size;
    const int32_t* gtable = Stage(dkv.page_table, pages, kSlotGradTable, op);
    // dkv.page_mask is the forward view's mask in the engine; like the CPU, selection follows kv.page_mask.
    const T* D = LaunchRowDot(s, dout, out, workspace, op);
    DispatchHeadDim(s.head_dim, op, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      using C = Cfg<T, HD>;
      const size_t dq_bytes = SharedMemory(DqKernel<T, HD>, C::Bytes(4, 1), op);
      const dim3 dq_grid(Tiles(s.n, C::kTile), static_cast<unsigned>(s.heads));
      DqKernel<T, HD><<<dq_grid, kThreads, dq_bytes, Stream()>>>(a, q, dout, lse, D, dq);
      const size_t kv_bytes = SharedMemory(DkdvKernel<T, HD>, C::Bytes(4, 2), op);
      const dim3 kv_grid(Tiles(a.kv_total - a.key_begin, C::kTile), static_cast<unsigned>(s.kv_heads));
      DkdvKernel<T, HD><<<kv_grid, kThreads, kv_bytes, Stream()>>>(a, q, dout, lse, D, dkv.k_pool, dkv.v_pool,
                                                                   gtable, dkv.page_stride);
    });
  }
  End(op);
}

template void AttentionForward<float>(const AttentionShape&, const float*, const PagedKV<float>&, float*, float*,
                                      float*);
template void AttentionForward<double>(const AttentionShape&, const double*, const PagedKV<double>&, double*,
                                       double*, double*);
template void AttentionBackward<float>(const AttentionShape&, const float*, const PagedKV<float>&, const float*,
                                       const float*, const float*, float*, const PagedKV<float>&, float*);
template void AttentionBackward<double>(const AttentionShape&, const double*, const PagedKV<double>&,
                                        const double*, const double*, const double*, double*,
                                        const PagedKV<double>&, double*);

}  // namespace sg::cuda
