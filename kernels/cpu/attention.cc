// Flash-style causal GQA attention over a paged KV cache, forward and backward.
//
// Keys are visited one page at a time, so scratch memory is O(query_block x page) whatever the cache length.
// Forward keeps a running max and sum per query row (online softmax) and saves only the logsumexp.
// Backward recomputes P = exp(S - lse) page by page, with softmax's backward in the same pass, and the row terms
// D_i = dO_i . O_i once per call. It is split into work items (kv head g, key stripe s):
// stripe s owns the pages p with p % stripes == s, so dK/dV pages have a single writer (deterministic, no
// atomics); dQ partial sums per stripe go to private buffers that are added up at the end. Gradient pages marked
// absent (-1) get no dK/dV: their positions' state gradient is not wanted (spaco's dropped chunks). Pages stored in
// bf16 (--dtype=bf16) are read in fp32 (forward: tile by tile; backward: a page at a time); a call's dK/dV for a
// page sum in fp32 and are rounded once into it.
// Under --matmul=bf16 (f32 only) the six products take bf16 operands, as PyTorch's flash attention does for bf16
// inputs: the f32 Q, P, dO and dS blocks are rounded into per-thread bf16 buffers, once each although two
// products read them, and bf16 pages are used as they are; the softmax statistics, D and the dQ/dK/dV sums stay
// fp32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/vexp.h"

namespace sg::cpu {
namespace {

// Query rows per block: 256 (as PyTorch's CPU flash attention uses for long sequences) x 256-key pages keeps a
// block's scores in L2 and each K/V page is read by a quarter as many blocks as with 64 rows; measured with
// attention_bench: 2-4% less CPU time than 64 at T = 4096 (the GEMMs already run near oneDNN's small-shape rate).
constexpr int64_t kQueryBlock = 256;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per thread: the forward's scores and row max and sum; the backward's P and dP.
int64_t PerThreadElems(int64_t page_size) { return 2 * kQueryBlock * page_size + 2 * kQueryBlock; }

int64_t BackwardStripes(const AttentionShape& s) {
  const int64_t threads = omp_get_max_threads();
  return s.kv_heads >= threads ? 1 : CeilDiv(threads, s.kv_heads);
}

// Per-row loops: the ISA-dispatched f32 builds (vexp.h), plain loops for f64 (the exactness reference).
inline float RowMax(const float* x, int64_t n) { return ActiveRowOps().max(x, n); }
inline float ExpShiftedSum(float* x, int64_t n, float shift) { return ActiveRowOps().exp_shifted_sum(x, n, shift); }
inline void SoftmaxBackward(float* p, float* dp, int64_t n, float lse, float d) {
  ActiveRowOps().softmax_backward(p, dp, n, lse, d);
}
inline float Dot(const float* a, const float* b, int64_t n) { return ActiveRowOps().dot(a, b, n); }
inline void ScaleRow(float* x, int64_t n, float a) { ActiveRowOps().scale(x, n, a); }

inline double RowMax(const double* x, int64_t n) { return *std::max_element(x, x + n); }
inline double ExpShiftedSum(double* x, int64_t n, double shift) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}
inline void SoftmaxBackward(double* p, double* dp, int64_t n, double lse, double d) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - lse);
    dp[i] = p[i] * (dp[i] - d);
  }
}
inline double Dot(const double* a, const double* b, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}
inline void ScaleRow(double* x, int64_t n, double a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// The storage type of KV pages: T, or bf16 (--dtype=bf16).
template <typename KV>
constexpr DType kPageType = std::is_same_v<KV, uint16_t> ? DType::kBF16 : DType::kF32;

// A product's operand: T values, or bf16 ones (a bf16 page, or a block rounded under --matmul=bf16).
struct Operand {
  DType type;
  const void* p;
  int64_t ld;
};

// C = alpha op(A) op(B) + beta C: GemmMixed, which follows --matmul (bf16: f32 operands rounded, fp32
// accumulation), for f32; Gemm<double> for the f64 reference (whose operands are all f64).
inline void Mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, Operand a, Operand b, float beta,
               float* c, int64_t ldc) {
  GemmMixed(ta, tb, m, n, k, alpha, a.type, a.p, a.ld, b.type, b.p, b.ld, beta, DType::kF32, c, ldc);
}
inline void Mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, Operand a, Operand b, double beta,
               double* c, int64_t ldc) {
  Gemm<double>(ta, tb, m, n, k, alpha, static_cast<const double*>(a.p), a.ld, static_cast<const double*>(b.p), b.ld,
               beta, c, ldc);
}

// rows x cols of x (leading dimension ld) as an operand. Under --matmul=bf16 (T = float) it is rounded here, once,
// into buf (per thread), for the products that read it more than once; otherwise it is used as it is.
template <typename T>
Operand Block(const T* x, int64_t rows, int64_t cols, int64_t ld, std::vector<uint16_t>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (MatmulRoundsToBF16()) {
      buf.resize(rows * cols);
      for (int64_t r = 0; r < rows; ++r) F32ToBF16Row(x + r * ld, cols, buf.data() + r * cols);
      return {DType::kBF16, buf.data(), cols};
    }
  }
  return {DType::kF32, x, ld};
}

// One kv head's slice of one page as the backward reads and writes it: K and V (stored as type), and where dK/dV
// go. Pages in T are used in place. bf16 pages (KV = uint16_t) are used in place too under --matmul=bf16 with bf16
// dot products; otherwise they are widened once per page into per-thread buffers (reused by every query block).
// Their dK/dV sum in fp32 buffers that Finish() adds into the bf16 pages, rounding once.
template <typename T, typename KV>
struct PageSlice {
  const void* k;
  const void* v;
  DType type = DType::kF32;  // of k and v (ignored for T = double)
  int64_t ld;  // of k and v
  T* dk = nullptr;
  T* dv = nullptr;
  int64_t ldd = 0;  // of dk and dv
  PageSlice(const PagedKV<KV>& kv, const PagedKV<KV>& dkv, int64_t lp, int64_t g, int64_t cols, int64_t hd,
            int64_t ldk, bool grad) {
    k = kv.k_page(lp) + g * hd;
    v = kv.v_page(lp) + g * hd;
    ld = ldk;
    if (grad) {
      dk = dkv.k_page(lp) + g * hd;
      dv = dkv.v_page(lp) + g * hd;
      ldd = ldk;
    }
  }
  void Finish() {}
};

template <>
struct PageSlice<float, uint16_t> {
  const void* k;
  const void* v;
  DType type = DType::kF32;
  int64_t ld;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t ldd = 0;
  uint16_t* dk_page = nullptr;
  uint16_t* dv_page = nullptr;
  int64_t rows, hd, ldk;
  PageSlice(const PagedKV<uint16_t>& kv, const PagedKV<uint16_t>& dkv, int64_t lp, int64_t g, int64_t cols,
            int64_t head_dim, int64_t ld_page, bool grad)
      : rows(cols), hd(head_dim), ldk(ld_page) {
    // Per thread, kept between calls: a few pages' worth of floats (not a tensor's), like GemmMixed's tiles.
    static thread_local std::vector<float> buf;
    buf.resize(4 * rows * hd);
    const uint16_t* kp = kv.k_page(lp) + g * hd;
    const uint16_t* vp = kv.v_page(lp) + g * hd;
    if (MatmulRoundsToBF16() && ActiveIsa() >= Isa::kAvx512Bf16) {
      k = kp;
      v = vp;
      type = DType::kBF16;
      ld = ldk;
    } else {
      float* kf = buf.data();
      float* vf = kf + rows * hd;
      for (int64_t r = 0; r < rows; ++r) {
        BF16ToF32Row(kp + r * ldk, hd, kf + r * hd);
        BF16ToF32Row(vp + r * ldk, hd, vf + r * hd);
      }
      k = kf;
      v = vf;
      ld = hd;
    }
    if (grad) {
      dk = buf.data() + 2 * rows * hd;
      dv = dk + rows * hd;
      std::fill(dk, dk + 2 * rows * hd, 0.0f);
      ldd = hd;
      dk_page = dkv.k_page(lp) + g * hd;
      dv_page = dkv.v_page(lp) + g * hd;
    }
  }
  void Finish() {
    if (!dk) return;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < hd; ++c) {
        uint16_t& a = dk_page[r * ldk + c];
        a = F32ToBF16(BF16ToF32(a) + dk[r * hd + c]);
        uint16_t& b = dv_page[r * ldk + c];
        b = F32ToBF16(BF16ToF32(b) + dv[r * hd + c]);
      }
  }
};

// Per thread, kept between calls: the bf16 copies of the Q, dO, P and dS blocks (--matmul=bf16). Here, not as
// statics of the exported templates below, whose function statics libseqgrad.so would export as unique symbols.
enum BlockBuffer { kQBlock, kDOBlock, kPBlock, kDSBlock, kNumBlockBuffers };
std::vector<uint16_t>& BF16Block(BlockBuffer which) {
  static thread_local std::vector<uint16_t> buffers[kNumBlockBuffers];
  return buffers[which];
}

}  // namespace

int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t page_size) {
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = PerThreadElems(page_size);
  const int64_t stripes = BackwardStripes(s);
  const int64_t dq_private = stripes > 1 ? stripes * s.n * s.heads * s.head_dim : 0;
  return threads * per_thread + s.heads * s.n + dq_private;
}

template <typename T, typename KV>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, T* out, T* lse, T* workspace) {
  const int64_t H = s.heads, hd = s.head_dim, group = s.heads / s.kv_heads, ps = kv.page_size;
  const int64_t ldq = H * hd, ldk = s.kv_heads * hd;
  const int64_t blocks = CeilDiv(s.n, kQueryBlock);
  const T scale = static_cast<T>(s.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t per_thread = PerThreadElems(ps);

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < H * blocks; ++item) {
    // Heaviest items (the last query blocks, which see the most pages) first, so the dynamic schedule ends even.
    const int64_t h = item % H, b = blocks - 1 - item / H, g = h / group;
    const int64_t i0 = b * kQueryBlock, bq = std::min(kQueryBlock, s.n - i0);
    const int64_t kv_len = s.pos0 + i0 + bq;
    T* S = workspace + omp_get_thread_num() * per_thread;
    T* m = S + kQueryBlock * ps;
    T* l = m + kQueryBlock;
    const Operand Qb = Block(q + i0 * ldq + h * hd, bq, hd, ldq, BF16Block(kQBlock));
    T* Ob = out + i0 * ldq + h * hd;
    for (int64_t r = 0; r < bq; ++r) {
      m[r] = neg_inf;
      l[r] = 0;
      std::fill(Ob + r * ldq, Ob + r * ldq + hd, T(0));
    }
    for (int64_t lp = s.key_begin / ps; lp * ps < kv_len; ++lp) {
      if (!kv.selected(lp)) continue;
      const int64_t j0 = lp * ps, cols = std::min(ps, kv_len - j0);
      const int64_t lo = std::clamp<int64_t>(s.key_begin - j0, 0, cols);  // keys of an earlier document
      const KV* Kp = kv.k_page(lp) + g * hd;
      const KV* Vp = kv.v_page(lp) + g * hd;
      Mm(false, true, bq, cols, hd, scale, Qb, {kPageType<KV>, Kp, ldk}, T(0), S, cols);
      for (int64_t r = 0; r < bq; ++r) {
        T* Sr = S + r * cols;
        const int64_t valid = std::clamp<int64_t>(s.pos0 + i0 + r - j0 + 1, 0, cols);
        std::fill(Sr, Sr + std::min(lo, valid), T(0));
        if (valid <= lo) {
          std::fill(Sr, Sr + cols, T(0));
          continue;
        }
        const T m_new = std::max(m[r], RowMax(Sr + lo, valid - lo));
        const T alpha = std::exp(m[r] - m_new);
        const T sum = ExpShiftedSum(Sr + lo, valid - lo, m_new);
        std::fill(Sr + valid, Sr + cols, T(0));
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        if (alpha != T(1)) ScaleRow(Ob + r * ldq, hd, alpha);
      }
      Mm(false, false, bq, hd, cols, T(1), {DType::kF32, S, cols}, {kPageType<KV>, Vp, ldk}, T(1), Ob, ldq);
    }
    for (int64_t r = 0; r < bq; ++r) {
      ScaleRow(Ob + r * ldq, hd, T(1) / l[r]);
      lse[h * s.n + i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

// Page-major (flash-attention 2's order): a work item owns a kv head's pages of its stripe and, page by page, runs
// every query block that sees the page, so the page's K, V, dK and dV stay in cache while Q, dO and dQ stream.
template <typename T, typename KV>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<KV>& dkv, T* workspace) {
  const int64_t H = s.heads, hd = s.head_dim, group = s.heads / s.kv_heads, ps = kv.page_size;
  const int64_t ldq = H * hd, ldk = s.kv_heads * hd;
  const int64_t blocks = CeilDiv(s.n, kQueryBlock);
  const int64_t stripes = BackwardStripes(s);
  const T scale = static_cast<T>(s.scale);
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = PerThreadElems(ps);
  T* D = workspace + threads * per_thread;  // D[h n + i] = dO_i . O_i for head h, softmax backward's row term
  T* dq_private = D + H * s.n;
  const int64_t dq_elems = s.n * ldq;
#pragma omp parallel for
  for (int64_t i = 0; i < s.n; ++i)
    for (int64_t h = 0; h < H; ++h) D[h * s.n + i] = Dot(dout + i * ldq + h * hd, out + i * ldq + h * hd, hd);
  if (stripes > 1) {
    std::fill(dq_private, dq_private + stripes * dq_elems, T(0));
  } else {
    std::fill(dq, dq + dq_elems, T(0));
  }
  const int64_t kv_len = s.pos0 + s.n;

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < s.kv_heads * stripes; ++item) {
    const int64_t g = item / stripes, stripe = item % stripes;
    T* P = workspace + omp_get_thread_num() * per_thread;
    T* dP = P + kQueryBlock * ps;
    T* dq_target = stripes > 1 ? dq_private + stripe * dq_elems : dq;
    for (int64_t lp = stripe; lp * ps < kv_len; lp += stripes) {
      if (!kv.selected(lp) || (lp + 1) * ps <= s.key_begin) continue;  // a page of an earlier document
      const int64_t j0 = lp * ps, cols = std::min(ps, kv_len - j0);
      const int64_t lo = std::clamp<int64_t>(s.key_begin - j0, 0, cols);
      PageSlice<T, KV> page(kv, dkv, lp, g, cols, hd, ldk, dkv.has_page(lp));
      // The first query block whose last row sees key j0.
      const int64_t first_block = std::max<int64_t>(0, (j0 - s.pos0) / kQueryBlock);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t b = first_block; b < blocks; ++b) {
          const int64_t i0 = b * kQueryBlock, bq = std::min(kQueryBlock, s.n - i0);
          if (s.pos0 + i0 + bq - 1 < j0) continue;
          // Q, dO, P and dS are each read by two products.
          const Operand Qb = Block(q + i0 * ldq + h * hd, bq, hd, ldq, BF16Block(kQBlock));
          const Operand dOb = Block(dout + i0 * ldq + h * hd, bq, hd, ldq, BF16Block(kDOBlock));
          T* dQb = dq_target + i0 * ldq + h * hd;
          const T* lse_b = lse + h * s.n + i0;
          const T* Db = D + h * s.n + i0;
          const Operand K{page.type, page.k, page.ld}, V{page.type, page.v, page.ld};
          Mm(false, true, bq, cols, hd, scale, Qb, K, T(0), P, cols);
          Mm(false, true, bq, cols, hd, T(1), dOb, V, T(0), dP, cols);
          for (int64_t r = 0; r < bq; ++r) {
            T* Pr = P + r * cols;
            T* dPr = dP + r * cols;
            const int64_t valid = std::clamp<int64_t>(s.pos0 + i0 + r - j0 + 1, 0, cols);
            const int64_t from = std::min(lo, valid);
            SoftmaxBackward(Pr + from, dPr + from, valid - from, lse_b[r], Db[r]);  // P, and dS in dP
            std::fill(Pr, Pr + from, T(0));
            std::fill(dPr, dPr + from, T(0));
            std::fill(Pr + valid, Pr + cols, T(0));
            std::fill(dPr + valid, dPr + cols, T(0));
          }
          const Operand dS = Block(dP, bq, cols, cols, BF16Block(kDSBlock));
          Mm(false, false, bq, hd, cols, scale, dS, K, T(1), dQb, ldq);
          if (!page.dk) continue;
          Mm(true, false, cols, hd, bq, scale, dS, Qb, T(1), page.dk, page.ldd);
          Mm(true, false, cols, hd, bq, T(1), Block(P, bq, cols, cols, BF16Block(kPBlock)), dOb, T(1), page.dv, page.ldd);
        }
      }
      page.Finish();
    }
  }
  if (stripes > 1) {
#pragma omp parallel for
    for (int64_t i = 0; i < dq_elems; ++i) {
      T acc = 0;
      for (int64_t st = 0; st < stripes; ++st) acc += dq_private[st * dq_elems + i];
      dq[i] = acc;
    }
  }
}

#define SG_INSTANTIATE(T, KV)                                                                                 \
  template void AttentionForward<T, KV>(const AttentionShape&, const T*, const PagedKV<KV>&, T*, T*, T*);     \
  template void AttentionBackward<T, KV>(const AttentionShape&, const T*, const PagedKV<KV>&, const T*,         \
                                         const T*, const T*, T*, const PagedKV<KV>&, T*);
SG_INSTANTIATE(float, float)
SG_INSTANTIATE(double, double)
SG_INSTANTIATE(float, uint16_t)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
