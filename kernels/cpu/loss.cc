// Cross-entropy over a chunk of logits (the LM head never materialises more than one chunk of them).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {

template <typename T>
double CrossEntropyForwardBackward(T* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale) {
  double total = 0;
#pragma omp parallel for reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * vocab;
    if (labels[i] < 0) {
      std::fill(row, row + vocab, T(0));
      continue;
    }
    const T mx = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    const double lse = mx + std::log(sum);
    total += lse - row[labels[i]];
    const double scale = row_scale ? row_scale[i] * grad_scale : grad_scale;
    for (int64_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(std::exp(row[j] - lse) * scale);
    row[labels[i]] -= static_cast<T>(scale);
  }
  return total;
}

template <typename T>
void TokenLogprobs(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const T* row = logits + i * vocab;
    if (labels[i] < 0) {
      out[i] = 0;
      continue;
    }
    const T mx = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    out[i] = row[labels[i]] - (mx + std::log(sum));
  }
}

template <typename T>
void TokenArgmax(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const T* row = logits + i * vocab;
    if (labels[i] < 0) {
      out[i] = -1;
      continue;
    }
    int64_t best = 0;
    for (int64_t j = 1; j < vocab; ++j)
      if (row[j] > row[best] || (row[best] != row[best] && row[j] == row[j])) best = j;  // NaN never wins
    out[i] = static_cast<int32_t>(best);
  }
}

template double CrossEntropyForwardBackward<float>(float*, const int32_t*, int64_t, int64_t, const double*, double);
template double CrossEntropyForwardBackward<double>(double*, const int32_t*, int64_t, int64_t, const double*, double);
template void TokenLogprobs<float>(const float*, const int32_t*, int64_t, int64_t, double*);
template void TokenLogprobs<double>(const double*, const int32_t*, int64_t, int64_t, double*);
template void TokenArgmax<float>(const float*, const int32_t*, int64_t, int64_t, int32_t*);
template void TokenArgmax<double>(const double*, const int32_t*, int64_t, int64_t, int32_t*);

}  // namespace sg::cpu
