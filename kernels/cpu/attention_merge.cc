// attention_merge (kernels/backend.h): combines attention over two disjoint sets of keys from their outputs and
// logsumexps, for attention over page groups (core/paged_attention.h).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {

template <typename T>
void AttentionMerge(const AttentionShape& s, T* out, T* lse, const T* out_b, const T* lse_b) {
  const int64_t H = s.heads, hd = s.head_dim, n = s.n;
  const T neg_inf = -std::numeric_limits<T>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < H * n; ++row) {
    const int64_t h = row / n, i = row % n;
    const T a = lse[row], b = lse_b[row];
    if (b == neg_inf) continue;  // nothing to add (out_b may be NaN there)
    T* o = out + (i * H + h) * hd;
    const T* ob = out_b + (i * H + h) * hd;
    if (a == neg_inf) {  // nothing yet (out may be NaN there)
      for (int64_t e = 0; e < hd; ++e) o[e] = ob[e];
      lse[row] = b;
      continue;
    }
    const T m = std::max(a, b), wa = std::exp(a - m), wb = std::exp(b - m), sum = wa + wb;
    const T ca = wa / sum, cb = wb / sum;
    for (int64_t e = 0; e < hd; ++e) o[e] = ca * o[e] + cb * ob[e];
    lse[row] = m + std::log(sum);
  }
}

template void AttentionMerge<float>(const AttentionShape&, float*, float*, const float*, const float*);
template void AttentionMerge<double>(const AttentionShape&, double*, double*, const double*, const double*);

}  // namespace sg::cpu
