// Tensor-core attention over KV and KV-gradient pages stored in bf16 (--dtype=bf16), forward and backward: the
// semantics of attention.cu's scalar kernels (and of kernels/cpu/attention.cc over bf16 pages) with every product
// on bf16 mma.sync (mma.cuh) accumulating in f32. q, out, lse, dO and dQ are f32: q and dO are rounded to bf16 where
// they enter a product, as are P and dS; softmax statistics and accumulators stay f32.
//
// A block has 4 warps, each owning 16 rows of the block's 64; a warp's scores stay in registers as mma C fragments
// and, rounded to bf16, become the A operand of the next product directly (AFromC), never going through shared
// memory. Shared tiles hold bf16 rows [rows][HD + 8] (head_dim zero-padded up to HD in {16, ..., 256}).
//   Forward: block = 64 query rows x head, over key tiles of kCols keys: S = Q K^T, online softmax per row (a row's
//            4 lanes reduce with two shuffles), O += P V; lse = m + log(l).
//   Backward: D = rowsum(dO * O) (attention.cuh), then
//     dQ:    block = 64 query rows x head, over key tiles: S, dP = dO V^T, dS = P (dP - D), dQ += dS K; assigned.
//     dK/dV: block = 64 keys x kv head g, over every head of group g and query tiles of kCols rows that see the
//            keys: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q in f32 registers, then added once into
//            the bf16 gradient pages (rounded once).
//   Key tiles (and dK/dV blocks) start at key_begin: keys of earlier packed documents are never read.
// Deterministic, no atomics: every element of dQ, dK and dV has one writer lane, which sums its terms in a fixed
// order. Rows that see no selected key get out = 0, lse = -inf and zero gradients, as the scalar kernels.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.cuh"
#include "kernels/cuda/mma.cuh"

namespace sg::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTcThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // query rows of a forward / dQ block, keys of a dK/dV block

template <int HD>
struct Tc {
  static constexpr int kLd = HD + 8;  // row stride (bf16): rows stay 16-byte aligned, fragment loads spread banks
  // Keys of a forward / dQ key tile and queries of a dK/dV query tile: the backward's shared memory stays under
  // 100 KiB at head_dim 256 (sm_80 and sm_90 allow 163 and 227 KiB per block).
  static constexpr int kCols = HD <= 128 ? 64 : 32;
  static constexpr int kCt = kCols / 8;  // n-tiles of a score tile
  static constexpr int kHt = HD / 8;     // n-tiles over the head dim
  static constexpr size_t Bytes(int tile_rows, int offsets, int floats) {
    return size_t(tile_rows) * kLd * sizeof(uint16_t) + size_t(offsets) * sizeof(int64_t) + size_t(floats) * 4;
  }
};

using Bf16Args = Args<float, uint16_t>;

// Whether tiles move in 16-byte chunks (LoadTile): KV rows (kv) and q / dO rows (rows) all 16-byte aligned.
struct TileVec {
  bool kv, rows;
};

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Row offsets are multiples of head_dim (and, for KV, of page_stride): with both multiples of 8 elements, every
// row starts 16-byte aligned when its array does.
TileVec VecFor(const AttentionShape& s, const PagedKV<uint16_t>& kv, const float* q, const float* dout) {
  const bool hd8 = s.head_dim % 8 == 0;
  return TileVec{hd8 && kv.page_stride % 8 == 0 && Aligned16(kv.k_pool) && Aligned16(kv.v_pool),
                 hd8 && Aligned16(q) && (dout == nullptr || Aligned16(dout))};
}

__device__ inline uint16_t Bits(uint16_t x) { return x; }
__device__ inline uint16_t Bits(float x) { return ToBf16(x); }

// 16 bytes (8 bf16 or 4 f32) moved as one access; p 16-byte aligned.
struct Chunk16 {
  uint32_t w[4];
};
__device__ inline Chunk16 Load16(const void* p) {
#ifdef __CUDACC__
  const uint4 v = *static_cast<const uint4*>(p);
  return Chunk16{{v.x, v.y, v.z, v.w}};
#else
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) sg_emu::DeviceError("a 16-byte load is not 16-byte aligned");
  Chunk16 c;
  std::memcpy(&c, p, 16);
  return c;
#endif
}
__device__ inline void Store16(void* p, const Chunk16& c) {
#ifdef __CUDACC__
  *static_cast<uint4*>(p) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
#else
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) sg_emu::DeviceError("a 16-byte store is not 16-byte aligned");
  std::memcpy(p, &c, 16);
#endif
}
// 8 consecutive elements of src at p as bf16.
__device__ inline Chunk16 Load8(const uint16_t* p) { return Load16(p); }
__device__ inline Chunk16 Load8(const float* p) {
  const Chunk16 lo = Load16(p), hi = Load16(p + 4);
  Chunk16 c;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    c.w[i] = PackF(__int_as_float(static_cast<int>(lo.w[2 * i])), __int_as_float(static_cast<int>(lo.w[2 * i + 1])));
    c.w[i + 2] =
        PackF(__int_as_float(static_cast<int>(hi.w[2 * i])), __int_as_float(static_cast<int>(hi.w[2 * i + 1])));
  }
  return c;
}

// dst[r][d] = src[off[r] + d] as bf16 for d < hd; zero for padded dims and rows with off[r] < 0. vec: every row
// offset and src are 16-byte aligned and hd % 8 == 0, so rows move in 8-element chunks.
template <int HD, typename S>
__device__ inline void LoadTile(uint16_t* dst, const S* src, const int64_t* off, int rows, int64_t hd, bool vec) {
  constexpr int LD = Tc<HD>::kLd;
  if (vec) {
    for (int idx = threadIdx.x; idx < rows * (HD / 8); idx += kTcThreads) {
      const int r = idx / (HD / 8), d = idx % (HD / 8) * 8;
      const int64_t o = off[r];
      Store16(dst + r * LD + d, o >= 0 && d < hd ? Load8(src + o + d) : Chunk16{{0, 0, 0, 0}});
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * HD; idx += kTcThreads) {
    const int r = idx / HD, d = idx % HD;
    const int64_t o = off[r];
    dst[r * LD + d] = (o >= 0 && d < hd) ? Bits(src[o + d]) : uint16_t(0);
  }
}

// Reductions over the 4 lanes holding one row of a C fragment (lanes 4g .. 4g + 3).
__device__ inline float QuadMax(float v) {
  v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int NT>
__device__ inline void ZeroC(float (&c)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) c[nt][i] = 0;
}

// The row (0..15 within the warp's 16) and column (within the n-tile) of element i of a lane's C fragment.
__device__ inline int FragRow(int i) { return LaneGroup() + 8 * (i >> 1); }
__device__ inline int FragCol(int i) { return 2 * LaneInGroup() + (i & 1); }

// c = A B^T over the head dim: A the warp's 16 rows at a, B the NT * 8 rows at b (both [rows][kLd]; NT even).
template <int HD, int NT>
__device__ inline void MulABt(float (&c)[NT][4], const uint16_t* a, const uint16_t* b) {
  constexpr int LD = Tc<HD>::kLd;
  ZeroC(c);
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    uint32_t af[4];
    LoadA(af, a + ks * 16, LD);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[2][2];
      LoadBT2(bf, b + nt * 8 * LD + ks * 16, LD);
      MmaBf16(c[nt], af, bf[0]);
      MmaBf16(c[nt + 1], af, bf[1]);
    }
  }
}

// acc += P B: P the warp's 16 x (NT * 8) f32 fragments (rounded to bf16), B the NT * 8 rows at b (HD / 8 even).
template <int HD, int NT>
__device__ inline void MulPB(float (&acc)[HD / 8][4], const float (&p)[NT][4], const uint16_t* b) {
  constexpr int LD = Tc<HD>::kLd;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t af[4];
    AFromC(af, p, kk);
#pragma unroll
    for (int ht = 0; ht < HD / 8; ht += 2) {
      uint32_t bf[2][2];
      LoadB2(bf, b + kk * 16 * LD + ht * 8, LD);
      MmaBf16(acc[ht], af, bf[0]);
      MmaBf16(acc[ht + 1], af, bf[1]);
    }
  }
}

// Offsets of query rows [i0, i0 + count) of head h in q / out / dO (-1 past the chunk).
__device__ inline void QueryRows(const Bf16Args& a, int64_t i0, int h, int count, int64_t* qoff) {
  for (int r = threadIdx.x; r < count; r += kTcThreads)
    qoff[r] = i0 + r < a.n ? (i0 + r) * a.heads * a.hd + h * a.hd : -1;
}

// Key offsets of the tile [j0, j0 + count) for kv head g; whether any key of it is read (block-wide).
__device__ inline bool KeyRows(const Bf16Args& a, int64_t j0, int g, int count, int64_t* koff) {
  bool any = false;
  for (int c = threadIdx.x; c < count; c += kTcThreads) {
    koff[c] = KeyOffset(a, j0 + c, g);
    any |= koff[c] >= 0;
  }
  return __syncthreads_or(any);
}

template <int HD>
__global__ void __launch_bounds__(kTcThreads)
    TcForwardKernel(Bf16Args a, TileVec vec, const float* q, float* out, float* lse) {
  using C = Tc<HD>;
  constexpr int LD = C::kLd, KT = C::kCols, NT = C::kCt;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + kRows * LD;
  uint16_t* sV = sK + KT * LD;
  int64_t* qoff = reinterpret_cast<int64_t*>(sV + KT * LD);
  int64_t* koff = qoff + kRows;
  const int warp = threadIdx.x / 32;
  const int h = blockIdx.y, g = h / static_cast<int>(a.group);
  const int64_t i0 = int64_t(blockIdx.x) * kRows;
  const int rows = static_cast<int>(Min64(kRows, a.n - i0));
  QueryRows(a, i0, h, kRows, qoff);
  __syncthreads();
  LoadTile<HD>(sQ, q, qoff, kRows, a.hd, vec.rows);
  const uint16_t* wQ = sQ + warp * 16 * LD;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
  float o[C::kHt][4];
  ZeroC(o);
  const int64_t kv_end = a.pos0 + i0 + rows;  // the block's last row sees keys [key_begin, kv_end)
  for (int64_t j0 = a.key_begin; j0 < kv_end; j0 += KT) {
    if (!KeyRows(a, j0, g, KT, koff)) continue;  // the whole tile lies in unselected pages
    LoadTile<HD>(sK, a.k_pool, koff, KT, a.hd, vec.kv);
    LoadTile<HD>(sV, a.v_pool, koff, KT, a.hd, vec.kv);
    __syncthreads();
    float s[NT][4];
    MulABt<HD>(s, wQ, sK);
    // Causal + page mask, then the online softmax update of the lane's two rows.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = warp * 16 + FragRow(i), c = nt * 8 + FragCol(i);
        const bool ok = r < rows && koff[c] >= 0 && j0 + c <= a.pos0 + i0 + r;
        s[nt][i] = ok ? s[nt][i] * a.scale : -INFINITY;
        mx[i >> 1] = max(mx[i >> 1], s[nt][i]);
      }
    float alpha[2], sum[2] = {0, 0};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = max(m[r], QuadMax(mx[r]));
      alpha[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);  // no key yet: nothing to rescale
      m[r] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nt][i] = s[nt][i] == -INFINITY ? 0.0f : expf(s[nt][i] - m[i >> 1]);
        sum[i >> 1] += s[nt][i];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + QuadSum(sum[r]);
#pragma unroll
    for (int ht = 0; ht < C::kHt; ++ht)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[ht][i] *= alpha[i >> 1];
    MulPB<HD>(o, s, sV);
    __syncthreads();  // before the next tile overwrites koff, sK, sV
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + LaneGroup() + 8 * r;
    if (row >= rows) continue;
    const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
#pragma unroll
    for (int ht = 0; ht < C::kHt; ++ht)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = ht * 8 + FragCol(j);
        if (d < a.hd) out[qoff[row] + d] = o[ht][2 * r + j] * inv;
      }
    if (LaneInGroup() == 0) lse[h * a.n + i0 + row] = l[r] > 0 ? m[r] + logf(l[r]) : -INFINITY;
  }
}

template <int HD>
__global__ void __launch_bounds__(kTcThreads)
    TcDqKernel(Bf16Args a, TileVec vec, const float* q, const float* dout, const float* lse, const float* D,
               float* dq) {
  using C = Tc<HD>;
  constexpr int LD = C::kLd, KT = C::kCols, NT = C::kCt;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdO = sQ + kRows * LD;
  uint16_t* sK = sdO + kRows * LD;
  uint16_t* sV = sK + KT * LD;
  int64_t* qoff = reinterpret_cast<int64_t*>(sV + KT * LD);
  int64_t* koff = qoff + kRows;
  const int warp = threadIdx.x / 32;
  const int h = blockIdx.y, g = h / static_cast<int>(a.group);
  const int64_t i0 = int64_t(blockIdx.x) * kRows;
  const int rows = static_cast<int>(Min64(kRows, a.n - i0));
  QueryRows(a, i0, h, kRows, qoff);
  __syncthreads();
  LoadTile<HD>(sQ, q, qoff, kRows, a.hd, vec.rows);
  LoadTile<HD>(sdO, dout, qoff, kRows, a.hd, vec.rows);
  const uint16_t* wQ = sQ + warp * 16 * LD;
  const uint16_t* wdO = sdO + warp * 16 * LD;
  float lr[2], dr[2];  // lse and D of the lane's rows; lse = -inf past the chunk gives P = 0 there
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + LaneGroup() + 8 * r;
    lr[r] = row < rows ? lse[h * a.n + i0 + row] : -INFINITY;
    dr[r] = row < rows ? D[h * a.n + i0 + row] : 0.0f;
  }
  float acc[C::kHt][4];
  ZeroC(acc);

  const int64_t kv_end = a.pos0 + i0 + rows;
  for (int64_t j0 = a.key_begin; j0 < kv_end; j0 += KT) {
    if (!KeyRows(a, j0, g, KT, koff)) continue;
    LoadTile<HD>(sK, a.k_pool, koff, KT, a.hd, vec.kv);
    LoadTile<HD>(sV, a.v_pool, koff, KT, a.hd, vec.kv);
    __syncthreads();
    float s[NT][4], dp[NT][4];
    MulABt<HD>(s, wQ, sK);
    MulABt<HD>(dp, wdO, sV);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = warp * 16 + FragRow(i), c = nt * 8 + FragCol(i);
        const float l = lr[i >> 1];
        const bool ok = l != -INFINITY && koff[c] >= 0 && j0 + c <= a.pos0 + i0 + r;
        const float p = ok ? expf(s[nt][i] * a.scale - l) : 0.0f;
        s[nt][i] = p * (dp[nt][i] - dr[i >> 1]);  // dS
      }
    MulPB<HD>(acc, s, sK);  // dQ += dS K (scaled once at the end)
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + LaneGroup() + 8 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int ht = 0; ht < C::kHt; ++ht)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = ht * 8 + FragCol(j);
        if (d < a.hd) dq[qoff[row] + d] = acc[ht][2 * r + j] * a.scale;
      }
  }
}

template <int HD>
__global__ void __launch_bounds__(kTcThreads)
    TcDkdvKernel(Bf16Args a, TileVec vec, const float* q, const float* dout, const float* lse, const float* D,
                 uint16_t* dk_pool, uint16_t* dv_pool, const int32_t* gtable, int64_t gstride) {
  using C = Tc<HD>;
  constexpr int LD = C::kLd, QT = C::kCols, NT = C::kCt;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + kRows * LD;
  uint16_t* sQ = sV + kRows * LD;
  uint16_t* sdO = sQ + QT * LD;
  int64_t* koff = reinterpret_cast<int64_t*>(sdO + QT * LD);
  int64_t* goff = koff + kRows;  // gradient row offset, -1 = no gradient wanted (or key not read)
  int64_t* qoff = goff + kRows;
  float* sL = reinterpret_cast<float*>(qoff + QT);  // lse of the query tile's rows (-inf past the chunk)
  float* sD = sL + QT;
  const int warp = threadIdx.x / 32;
  const int g = blockIdx.y;
  const int64_t j0 = a.key_begin + int64_t(blockIdx.x) * kRows;
  bool any = false;
  for (int c = threadIdx.x; c < kRows; c += kTcThreads) {
    koff[c] = KeyOffset(a, j0 + c, g);
    goff[c] = GradOffset(a, j0 + c, g, koff[c], gtable, gstride);
    any |= goff[c] >= 0;
  }
  if (!__syncthreads_or(any)) return;  // no key of this tile wants a gradient
  LoadTile<HD>(sK, a.k_pool, koff, kRows, a.hd, vec.kv);
  LoadTile<HD>(sV, a.v_pool, koff, kRows, a.hd, vec.kv);
  const uint16_t* wK = sK + warp * 16 * LD;
  const uint16_t* wV = sV + warp * 16 * LD;
  float dk[C::kHt][4], dv[C::kHt][4];  // the warp's 16 keys x head dim
  ZeroC(dk);
  ZeroC(dv);

  // Query i sees key j iff j <= pos0 + i: the first query row that sees this tile is j0 - pos0.
  const int64_t first = Max64(0, j0 - a.pos0);
  for (int64_t h = int64_t(g) * a.group; h < (g + 1) * a.group; ++h) {
    for (int64_t i0 = first; i0 < a.n; i0 += QT) {
      QueryRows(a, i0, static_cast<int>(h), QT, qoff);
      for (int r = threadIdx.x; r < QT; r += kTcThreads) {
        const bool in = i0 + r < a.n;
        sL[r] = in ? lse[h * a.n + i0 + r] : -INFINITY;
        sD[r] = in ? D[h * a.n + i0 + r] : 0.0f;
      }
      __syncthreads();
      LoadTile<HD>(sQ, q, qoff, QT, a.hd, vec.rows);
      LoadTile<HD>(sdO, dout, qoff, QT, a.hd, vec.rows);
      __syncthreads();
      float p[NT][4], ds[NT][4];  // transposed: rows = the warp's keys, columns = the tile's queries
      MulABt<HD>(p, wK, sQ);
      MulABt<HD>(ds, wV, sdO);  // dP^T
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = warp * 16 + FragRow(i), qi = nt * 8 + FragCol(i);
          const float l = sL[qi];
          const bool ok = l != -INFINITY && koff[key] >= 0 && j0 + key <= a.pos0 + i0 + qi;
          p[nt][i] = ok ? expf(p[nt][i] * a.scale - l) : 0.0f;
          ds[nt][i] = p[nt][i] * (ds[nt][i] - sD[qi]);
        }
      MulPB<HD>(dv, p, sdO);  // dV += P^T dO
      MulPB<HD>(dk, ds, sQ);  // dK += dS^T Q (scaled once at the end)
      __syncthreads();        // before the next query tile overwrites qoff, sL, sD, sQ, sdO
    }
  }
  // One read-modify-write per element, rounded once: the only writer of these gradient rows.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t go = goff[warp * 16 + LaneGroup() + 8 * r];
    if (go < 0) continue;
#pragma unroll
    for (int ht = 0; ht < C::kHt; ++ht)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = ht * 8 + FragCol(j);
        if (d >= a.hd) continue;
        dk_pool[go + d] = ToBf16(FromBf16(dk_pool[go + d]) + dk[ht][2 * r + j] * a.scale);
        dv_pool[go + d] = ToBf16(FromBf16(dv_pool[go + d]) + dv[ht][2 * r + j]);
      }
  }
}

}  // namespace

void AttentionForwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, float* out,
                          float* lse, float* /*workspace*/) {
  const char* op = "attention_forward_bf16";
  if (s.n > 0) {
    const Bf16Args a = MakeArgs<float>(s, kv, op);
    DispatchHeadDim(s.head_dim, op, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      using C = Tc<HD>;
      const size_t bytes =
          SharedMemory(TcForwardKernel<HD>, C::Bytes(kRows + 2 * C::kCols, kRows + C::kCols, 0), op);
      const dim3 grid(Tiles(s.n, kRows), static_cast<unsigned>(s.heads));
      TcForwardKernel<HD><<<grid, kTcThreads, bytes, Stream()>>>(a, VecFor(s, kv, q, nullptr), q, out, lse);
    });
  }
  End(op);
}

void AttentionBackwardBf16(const AttentionShape& s, const float* q, const PagedKV<uint16_t>& kv, const float* out,
                           const float* lse, const float* dout, float* dq, const PagedKV<uint16_t>& dkv,
                           float* workspace) {
  const char* op = "attention_backward_bf16";
  if (s.n > 0) {
    const Bf16Args a = MakeArgs<float>(s, kv, op);
    const int64_t pages = (a.kv_total + kv.page_size - 1) / kv.page_size;
    const int32_t* gtable = Stage(dkv.page_table, pages, kSlotGradTable, op);
    // Like the scalar kernels and the CPU, selection follows kv.page_mask.
    const float* D = LaunchRowDot(s, dout, out, workspace, op);
    const TileVec vec = VecFor(s, kv, q, dout);
    DispatchHeadDim(s.head_dim, op, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      using C = Tc<HD>;
      const size_t dq_bytes =
          SharedMemory(TcDqKernel<HD>, C::Bytes(2 * kRows + 2 * C::kCols, kRows + C::kCols, 0), op);
      const dim3 dq_grid(Tiles(s.n, kRows), static_cast<unsigned>(s.heads));
      TcDqKernel<HD><<<dq_grid, kTcThreads, dq_bytes, Stream()>>>(a, vec, q, dout, lse, D, dq);
      const size_t kv_bytes = SharedMemory(
          TcDkdvKernel<HD>, C::Bytes(2 * kRows + 2 * C::kCols, 2 * kRows + C::kCols, 2 * C::kCols), op);
      const dim3 kv_grid(Tiles(a.kv_total - a.key_begin, kRows), static_cast<unsigned>(s.kv_heads));
      TcDkdvKernel<HD><<<kv_grid, kTcThreads, kv_bytes, Stream()>>>(a, vec, q, dout, lse, D, dkv.k_pool,
                                                                     dkv.v_pool, gtable, dkv.page_stride);
    });
  }
  End(op);
}

}  // namespace sg::cuda
