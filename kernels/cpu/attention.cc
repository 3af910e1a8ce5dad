// Flash-style causal GQA attention over a paged KV cache, forward and backward.
//
// Keys are visited one page at a time, so scratch memory is O(query_block x page) whatever the cache length.
// Forward keeps a running max and sum per query row (online softmax) and saves only the logsumexp.
// Backward recomputes P = exp(S - lse) page by page. It is split into work items (kv head g, key stripe s):
// stripe s owns the pages p with p % stripes == s, so dK/dV pages have a single writer (deterministic, no
// atomics); dQ partial sums per stripe go to private buffers that are added up at the end. Gradient pages marked
// absent (-1) get no dK/dV: their positions' state gradient is not wanted (spaco's dropped chunks). Pages stored in
// bf16 (--dtype=bf16) are read tile by tile in fp32; dK/dV accumulate in fp32 per product, rounded once into a page.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/vexp.h"

namespace sg::cpu {
namespace {

constexpr int64_t kQueryBlock = 64;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t BackwardStripes(const AttentionShape& s) {
  const int64_t threads = omp_get_max_threads();
  return s.kv_heads >= threads ? 1 : CeilDiv(threads, s.kv_heads);
}

// Products with a KV page stored as KV: T, or bf16 (--dtype=bf16), whose tiles GemmMixed converts.
// C = alpha A op(page) + beta C.
template <typename T, typename KV>
void GemmPage(bool trans_page, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const KV* page,
              int64_t ldp, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, KV>) {
    Gemm<T>(false, trans_page, m, n, k, alpha, a, lda, page, ldp, beta, c, ldc);
  } else {
    GemmMixed(false, trans_page, m, n, k, alpha, DType::kF32, a, lda, DType::kBF16, page, ldp, beta, DType::kF32, c,
              ldc);
  }
}
// page += alpha A^T B (dK, dV), accumulated in fp32 and rounded once into a bf16 page.
template <typename T, typename KV>
void GemmIntoPage(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
                  KV* page, int64_t ldp) {
  if constexpr (std::is_same_v<T, KV>) {
    Gemm<T>(true, false, m, n, k, alpha, a, lda, b, ldb, T(1), page, ldp);
  } else {
    GemmMixed(true, false, m, n, k, alpha, DType::kF32, a, lda, DType::kF32, b, ldb, 1.0f, DType::kBF16, page, ldp);
  }
}

}  // namespace

int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t page_size) {
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = 2 * kQueryBlock * page_size + 3 * kQueryBlock;
  const int64_t stripes = BackwardStripes(s);
  const int64_t dq_private = stripes > 1 ? stripes * s.n * s.heads * s.head_dim : 0;
  return threads * per_thread + dq_private;
}

template <typename T, typename KV>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, T* out, T* lse, T* workspace) {
  const int64_t H = s.heads, hd = s.head_dim, group = s.heads / s.kv_heads, ps = kv.page_size;
  const int64_t ldq = H * hd, ldk = s.kv_heads * hd;
  const int64_t blocks = CeilDiv(s.n, kQueryBlock);
  const T scale = static_cast<T>(s.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t per_thread = 2 * kQueryBlock * ps + 3 * kQueryBlock;

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < H * blocks; ++item) {
    const int64_t h = item / blocks, b = item % blocks, g = h / group;
    const int64_t i0 = b * kQueryBlock, bq = std::min(kQueryBlock, s.n - i0);
    const int64_t kv_len = s.pos0 + i0 + bq;
    T* S = workspace + omp_get_thread_num() * per_thread;
    T* m = S + 2 * kQueryBlock * ps;
    T* l = m + kQueryBlock;
    const T* Qb = q + i0 * ldq + h * hd;
    T* Ob = out + i0 * ldq + h * hd;
    for (int64_t r = 0; r < bq; ++r) {
      m[r] = neg_inf;
      l[r] = 0;
      std::fill(Ob + r * ldq, Ob + r * ldq + hd, T(0));
    }
    for (int64_t lp = 0; lp * ps < kv_len; ++lp) {
      if (!kv.selected(lp)) continue;
      const int64_t j0 = lp * ps, cols = std::min(ps, kv_len - j0);
      const KV* Kp = kv.k_page(lp) + g * hd;
      const KV* Vp = kv.v_page(lp) + g * hd;
      GemmPage<T, KV>(true, bq, cols, hd, scale, Qb, ldq, Kp, ldk, T(0), S, cols);
      for (int64_t r = 0; r < bq; ++r) {
        T* Sr = S + r * cols;
        const int64_t valid = std::clamp<int64_t>(s.pos0 + i0 + r - j0 + 1, 0, cols);
        if (valid == 0) {
          std::fill(Sr, Sr + cols, T(0));
          continue;
        }
        T mx = Sr[0];
#pragma omp simd reduction(max : mx)
        for (int64_t c = 1; c < valid; ++c) mx = std::max(mx, Sr[c]);
        const T m_new = std::max(m[r], mx);
        const T alpha = std::exp(m[r] - m_new);
        ExpShifted(Sr, valid, m_new);
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < valid; ++c) sum += Sr[c];
        std::fill(Sr + valid, Sr + cols, T(0));
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        if (alpha != T(1)) {
          T* o = Ob + r * ldq;
          for (int64_t c = 0; c < hd; ++c) o[c] *= alpha;
        }
      }
      GemmPage<T, KV>(false, bq, hd, cols, T(1), S, cols, Vp, ldk, T(1), Ob, ldq);
    }
    for (int64_t r = 0; r < bq; ++r) {
      const T inv = T(1) / l[r];
      T* o = Ob + r * ldq;
      for (int64_t c = 0; c < hd; ++c) o[c] *= inv;
      lse[h * s.n + i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

template <typename T, typename KV>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<KV>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<KV>& dkv, T* workspace) {
  const int64_t H = s.heads, hd = s.head_dim, group = s.heads / s.kv_heads, ps = kv.page_size;
  const int64_t ldq = H * hd, ldk = s.kv_heads * hd;
  const int64_t blocks = CeilDiv(s.n, kQueryBlock);
  const int64_t stripes = BackwardStripes(s);
  const T scale = static_cast<T>(s.scale);
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = 2 * kQueryBlock * ps + 3 * kQueryBlock;
  T* dq_private = workspace + threads * per_thread;
  const int64_t dq_elems = s.n * ldq;
  if (stripes > 1) {
    std::fill(dq_private, dq_private + stripes * dq_elems, T(0));
  } else {
    std::fill(dq, dq + dq_elems, T(0));
  }

#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < s.kv_heads * stripes; ++item) {
    const int64_t g = item / stripes, stripe = item % stripes;
    T* P = workspace + omp_get_thread_num() * per_thread;
    T* dP = P + kQueryBlock * ps;
    T* D = dP + kQueryBlock * ps;
    T* dq_target = stripes > 1 ? dq_private + stripe * dq_elems : dq;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i0 = b * kQueryBlock, bq = std::min(kQueryBlock, s.n - i0);
        const int64_t kv_len = s.pos0 + i0 + bq;
        const T* Qb = q + i0 * ldq + h * hd;
        const T* dOb = dout + i0 * ldq + h * hd;
        const T* Ob = out + i0 * ldq + h * hd;
        T* dQb = dq_target + i0 * ldq + h * hd;
        const T* lse_b = lse + h * s.n + i0;
        for (int64_t r = 0; r < bq; ++r) {
          T acc = 0;
          for (int64_t c = 0; c < hd; ++c) acc += dOb[r * ldq + c] * Ob[r * ldq + c];
          D[r] = acc;
        }
        for (int64_t lp = stripe; lp * ps < kv_len; lp += stripes) {
          if (!kv.selected(lp)) continue;
          const int64_t j0 = lp * ps, cols = std::min(ps, kv_len - j0);
          const KV* Kp = kv.k_page(lp) + g * hd;
          const KV* Vp = kv.v_page(lp) + g * hd;
          GemmPage<T, KV>(true, bq, cols, hd, scale, Qb, ldq, Kp, ldk, T(0), P, cols);
          GemmPage<T, KV>(true, bq, cols, hd, T(1), dOb, ldq, Vp, ldk, T(0), dP, cols);
          for (int64_t r = 0; r < bq; ++r) {
            T* Pr = P + r * cols;
            T* dPr = dP + r * cols;
            const int64_t valid = std::clamp<int64_t>(s.pos0 + i0 + r - j0 + 1, 0, cols);
            ExpShifted(Pr, valid, lse_b[r]);
            const T Dr = D[r];
#pragma omp simd
            for (int64_t c = 0; c < valid; ++c) dPr[c] = Pr[c] * (dPr[c] - Dr);  // dS
            std::fill(Pr + valid, Pr + cols, T(0));
            std::fill(dPr + valid, dPr + cols, T(0));
          }
          GemmPage<T, KV>(false, bq, hd, cols, scale, dP, cols, Kp, ldk, T(1), dQb, ldq);
          if (!dkv.has_page(lp)) continue;
          KV* dKp = dkv.k_page(lp) + g * hd;
          KV* dVp = dkv.v_page(lp) + g * hd;
          GemmIntoPage<T, KV>(cols, hd, bq, scale, dP, cols, Qb, ldq, dKp, ldk);
          GemmIntoPage<T, KV>(cols, hd, bq, T(1), P, cols, dOb, ldq, dVp, ldk);
        }
      }
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
