// Work inside a chunk that core once did in host loops (ops.inc's in-chunk block): LoRA dropout, Mamba's A =
// -exp(A_log) and its gradient, sparse attention's key sums and page scores. The CUDA kernels
// (kernels/cuda/chunk_ops.cu) do the same arithmetic in the same order: the same bits.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/dropout_mask.h"

namespace sg::cpu {

template <typename T>
void LoraDropout(const T* x, int64_t n, int64_t cols, uint64_t seed, uint64_t module, int64_t pos0, int64_t col0,
                 double p, bool accumulate, T* y) {
  const T keep = static_cast<T>(1.0 / (1.0 - p));
#pragma omp parallel for if (n * cols >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = LoraRowKey(seed, module, pos0 + i);
    for (int64_t j = 0; j < cols; ++j) {
      const bool kept = LoraKeep(key, col0 + j, p);
      if (accumulate) {
        if (kept) y[i * cols + j] += x[i * cols + j] * keep;
      } else {
        y[i * cols + j] = kept ? x[i * cols + j] * keep : T(0);
      }
    }
  }
}

template <typename T>
void SsmNegExp(const T* a_log, int64_t count, T* a) {
  for (int64_t i = 0; i < count; ++i) a[i] = -std::exp(a_log[i]);
}

template <typename T>
void SsmNegExpBackward(const T* da, const T* a, int64_t count, T* da_log) {
  for (int64_t i = 0; i < count; ++i) da_log[i] += da[i] * a[i];
}

template <typename T>
void ColumnSumsF64(const T* x, int64_t rows, int64_t cols, double* sums) {
  for (int64_t j = 0; j < cols; ++j) sums[j] = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) sums[j] += static_cast<double>(x[i * cols + j]);
}

void PageScores(const double* q_sums, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const double* key_sums, int64_t first, int64_t count, int64_t page_size, double* scores) {
  const int64_t group = heads / kv_heads, width = kv_heads * head_dim;
  std::vector<double> g(width, 0.0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t e = 0; e < head_dim; ++e)
      g[(h / group) * head_dim + e] += q_sums[h * head_dim + e] / static_cast<double>(n);
  for (int64_t i = 0; i < count; ++i) {
    const double* k = key_sums + (first + i) * width;
    double acc = 0;
    for (int64_t e = 0; e < width; ++e) acc += g[e] * k[e];
    scores[i] = acc / static_cast<double>(page_size);
  }
}

#define SG_INSTANTIATE(T)                                                                                           \
  template void LoraDropout<T>(const T*, int64_t, int64_t, uint64_t, uint64_t, int64_t, int64_t, double, bool, T*); \
  template void SsmNegExp<T>(const T*, int64_t, T*);                                                                \
  template void SsmNegExpBackward<T>(const T*, const T*, int64_t, T*);                                              \
  template void ColumnSumsF64<T>(const T*, int64_t, int64_t, double*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
