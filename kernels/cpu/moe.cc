// Mixture of experts: the router (softmax, top-k, optional renormalisation) forward and backward, and the row ops
// around the experts (gather, scatter-add, per-row dots). OpenMP over rows.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {
namespace {

// The router's order: higher probability first, equal ones by lower expert index (torch.topk on the CPU agrees on
// near-ties; on exact ties its order is unspecified). NaN (from NaN or infinite logits) ranks below every number, so
// the order is total and every pass picks an expert.
bool Precedes(double pa, int64_t a, double pb, int64_t b) {
  const bool nan_a = std::isnan(pa), nan_b = std::isnan(pb);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && pa != pb) return pa > pb;
  return a < b;
}

// One row: probs = softmax(logits) in double (max subtracted); top = the k first experts in the router's order, by
// k passes each taking the first expert after the previous pick; weights their probabilities, over their sum when
// normalize.
template <typename T>
void RouteRow(const T* logits, int64_t experts, int64_t k, bool normalize, T* probs, int32_t* top, T* weights) {
  double max = logits[0];
  for (int64_t e = 1; e < experts; ++e) max = std::fmax(max, logits[e]);
  double sum = 0;
  for (int64_t e = 0; e < experts; ++e) sum += std::exp(logits[e] - max);
  for (int64_t e = 0; e < experts; ++e) probs[e] = T(std::exp(logits[e] - max) / sum);
  double picked = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      const bool after_previous = j == 0 || Precedes(probs[top[j - 1]], top[j - 1], probs[e], e);
      if (after_previous && (best < 0 || Precedes(probs[e], e, probs[best], best))) best = e;
    }
    top[j] = static_cast<int32_t>(best);
    weights[j] = probs[best];
    picked += probs[best];
  }
  if (normalize)
    for (int64_t j = 0; j < k; ++j) weights[j] = T(weights[j] / picked);
}

// One row's backward; dlogits holds the gradient of the probabilities first. With normalisation, w_j = p_j / S
// (S the sum of the picked p): dp_j = (dw_j - sum_i dw_i w_i) / S. Then the softmax's dlogits = p (dp - sum dp p).
template <typename T>
void RouteRowBackward(const T* dweights, const T* probs, const int32_t* top, int64_t experts, int64_t k, bool normalize,
                      const T* dprobs_extra, T* dlogits) {
  double picked = 0, dot_dw_w = 0;
  if (normalize) {
    for (int64_t j = 0; j < k; ++j) picked += probs[top[j]];
    for (int64_t j = 0; j < k; ++j) dot_dw_w += double(dweights[j]) * (probs[top[j]] / picked);
  }
  for (int64_t e = 0; e < experts; ++e) dlogits[e] = dprobs_extra ? dprobs_extra[e] : T(0);
  for (int64_t j = 0; j < k; ++j) dlogits[top[j]] += normalize ? T((dweights[j] - dot_dw_w) / picked) : dweights[j];
  double dot = 0;
  for (int64_t e = 0; e < experts; ++e) dot += double(dlogits[e]) * probs[e];
  for (int64_t e = 0; e < experts; ++e) dlogits[e] = T(probs[e] * (dlogits[e] - dot));
}

void CheckRoute(int64_t experts, int64_t k, const char* op) {
  if (experts < 1 || k < 1 || k > experts)
    throw std::invalid_argument(std::string(op) + ": k = " + std::to_string(k) + " experts per token must lie in [1, " +
                                std::to_string(experts) + "] (the number of experts)");
}

bool Threaded(int64_t work) { return work > 16384; }

}  // namespace

template <typename T>
void MoeRoute(const T* logits, int64_t n, int64_t experts, int64_t k, bool normalize, T* probs, int32_t* top,
              T* weights) {
  CheckRoute(experts, k, "moe_route");
#pragma omp parallel for if (Threaded(n * experts * k))
  for (int64_t i = 0; i < n; ++i)
    RouteRow(logits + i * experts, experts, k, normalize, probs + i * experts, top + i * k, weights + i * k);
}

template <typename T>
void MoeRouteBackward(const T* dweights, const T* probs, const int32_t* top, int64_t n, int64_t experts, int64_t k,
                      bool normalize, const T* dprobs_extra, T* dlogits) {
  CheckRoute(experts, k, "moe_route_backward");
  for (int64_t i = 0; i < n * k; ++i)
    if (top[i] < 0 || top[i] >= experts)
      throw std::invalid_argument("moe_route_backward: top[" + std::to_string(i) + "] = " + std::to_string(top[i]) +
                                  " is not an expert of " + std::to_string(experts));
#pragma omp parallel for if (Threaded(n * experts))
  for (int64_t i = 0; i < n; ++i)
    RouteRowBackward(dweights + i * k, probs + i * experts, top + i * k, experts, k, normalize, dprobs_extra,
                     dlogits + i * experts);
}

template <typename T>
void GatherRows(const T* src, const int32_t* index, int64_t rows, int64_t cols, T* dst) {
#pragma omp parallel for if (Threaded(rows * cols))
  for (int64_t i = 0; i < rows; ++i) {
    const T* from = src + index[i] * cols;
    std::copy(from, from + cols, dst + i * cols);
  }
}

// Indices are distinct within a call, so the rows never race.
template <typename T>
void ScatterAddRows(const T* src, const int32_t* index, const T* scale, int64_t rows, int64_t cols, T* dst) {
#pragma omp parallel for if (Threaded(rows * cols))
  for (int64_t i = 0; i < rows; ++i) {
    const T* from = src + i * cols;
    T* to = dst + index[i] * cols;
    const T s = scale ? scale[i] : T(1);
    for (int64_t c = 0; c < cols; ++c) to[c] += s * from[c];
  }
}

// Summed in double, in column order.
template <typename T>
void RowDots(const T* a, const T* b, int64_t rows, int64_t cols, T* out) {
#pragma omp parallel for if (Threaded(rows * cols))
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += double(a[i * cols + c]) * b[i * cols + c];
    out[i] = T(s);
  }
}

#define SG_INSTANTIATE(T)                                                                                          \
  template void MoeRoute<T>(const T*, int64_t, int64_t, int64_t, bool, T*, int32_t*, T*);                          \
  template void MoeRouteBackward<T>(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, bool, const T*, \
                                    T*);                                                                           \
  template void GatherRows<T>(const T*, const int32_t*, int64_t, int64_t, T*);                                     \
  template void ScatterAddRows<T>(const T*, const int32_t*, const T*, int64_t, int64_t, T*);                       \
  template void RowDots<T>(const T*, const T*, int64_t, int64_t, T*);
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE

}  // namespace sg::cpu
