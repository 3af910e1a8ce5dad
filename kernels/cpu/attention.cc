// Flash-style causal GQA attention over a paged KV cache, forward and backward.
//
// Keys are visited one page at a time, so scratch memory is O(query_block x page) whatever the cache length.
// Forward keeps a running max and sum per query row (online softmax) and saves only the logsumexp.
// Backward recomputes P = exp(S - lse) page by page. It is split into work items (kv head g, key stripe s):
// stripe s owns the pages p with p % stripes == s, so dK/dV pages have a single writer (deterministic, no
// atomics); dQ partial sums per stripe go to private buffers that are added up at the end. Gradient pages marked
// absent (-1) get no dK/dV: their positions' state gradient is not wanted (spaco's dropped chunks).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

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

}  // namespace

int64_t AttentionWorkspaceElems(const AttentionShape& s, int64_t page_size) {
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = 2 * kQueryBlock * page_size + 3 * kQueryBlock;
  const int64_t stripes = BackwardStripes(s);
  const int64_t dq_private = stripes > 1 ? stripes * s.n * s.heads * s.head_dim : 0;
  return threads * per_thread + dq_private;
}

template <typename T>
void AttentionForward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, T* out, T* lse, T* workspace) {
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
      const T* Kp = kv.k_page(lp) + g * hd;
      const T* Vp = kv.v_page(lp) + g * hd;
      Gemm<T>(false, true, bq, cols, hd, scale, Qb, ldq, Kp, ldk, T(0), S, cols);
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
      Gemm<T>(false, false, bq, hd, cols, T(1), S, cols, Vp, ldk, T(1), Ob, ldq);
    }
    for (int64_t r = 0; r < bq; ++r) {
      const T inv = T(1) / l[r];
      T* o = Ob + r * ldq;
      for (int64_t c = 0; c < hd; ++c) o[c] *= inv;
      lse[h * s.n + i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

template <typename T>
void AttentionBackward(const AttentionShape& s, const T* q, const PagedKV<T>& kv, const T* out, const T* lse,
                       const T* dout, T* dq, const PagedKV<T>& dkv, T* workspace) {
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
          const T* Kp = kv.k_page(lp) + g * hd;
          const T* Vp = kv.v_page(lp) + g * hd;
          Gemm<T>(false, true, bq, cols, hd, scale, Qb, ldq, Kp, ldk, T(0), P, cols);
          Gemm<T>(false, true, bq, cols, hd, T(1), dOb, ldq, Vp, ldk, T(0), dP, cols);
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
          Gemm<T>(false, false, bq, hd, cols, scale, dP, cols, Kp, ldk, T(1), dQb, ldq);
          if (!dkv.has_page(lp)) continue;
          T* dKp = dkv.k_page(lp) + g * hd;
          T* dVp = dkv.v_page(lp) + g * hd;
          Gemm<T>(true, false, cols, hd, bq, scale, dP, cols, Qb, ldq, T(1), dKp, ldk);
          Gemm<T>(true, false, cols, hd, bq, T(1), P, cols, dOb, ldq, T(1), dVp, ldk);
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

template void AttentionForward<float>(const AttentionShape&, const float*, const PagedKV<float>&, float*, float*,
                                      float*);
template void AttentionForward<double>(const AttentionShape&, const double*, const PagedKV<double>&, double*,
                                       double*, double*);
template void AttentionBackward<float>(const AttentionShape&, const float*, const PagedKV<float>&, const float*,
                                       const float*, const float*, float*, const PagedKV<float>&, float*);
template void AttentionBackward<double>(const AttentionShape&, const double*, const PagedKV<double>&,
                                        const double*, const double*, const double*, double*,
                                        const PagedKV<double>&, double*);

}  // namespace sg::cpu
