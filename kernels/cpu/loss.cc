// Cross-entropy over a chunk of logits (the LM head never materialises more than one chunk of them).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {

namespace {

// One row of logits (label >= 0): the token loss lse - row[label]; row becomes scale (softmax - onehot(label)).
template <typename T>
double CrossEntropyRow(T* row, int32_t label, int64_t vocab, double scale) {
  const T mx = *std::max_element(row, row + vocab);
  double sum = 0;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
  const double lse = mx + std::log(sum);
  const double loss = lse - row[label];
  for (int64_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(std::exp(row[j] - lse) * scale);
  row[label] -= static_cast<T>(scale);
  return loss;
}

template <typename T>
double LogprobRow(const T* row, int32_t label, int64_t vocab) {
  const T mx = *std::max_element(row, row + vocab);
  double sum = 0;
  for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
  return row[label] - (mx + std::log(sum));
}

template <typename T>
int32_t ArgmaxRow(const T* row, int64_t vocab) {
  int64_t best = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (row[j] > row[best] || (row[best] != row[best] && row[j] == row[j])) best = j;  // NaN never wins
  return static_cast<int32_t>(best);
}

// The rows' losses summed in row order, as the CUDA kernel sums them: an OpenMP reduction combines the threads'
// partial sums in the order they finish, so the loss would differ in its last bits from run to run.
double InRowOrder(const std::vector<double>& losses) {
  double total = 0;
  for (double l : losses) total += l;
  return total;
}

// The op's contract for its sum: added to *device_sum (CPU memory is the device's) and 0 returned, or returned.
double Delivered(double total, double* device_sum) {
  if (!device_sum) return total;
  *device_sum += total;
  return 0;
}

// A bf16 row widened into a per-thread fp32 buffer (one row, never the chunk).
const float* Widened(const uint16_t* row, int64_t vocab) {
  static thread_local std::vector<float> buf;
  buf.resize(vocab);
  BF16ToF32Row(row, vocab, buf.data());
  return buf.data();
}

}  // namespace

template <typename T>
double CrossEntropyForwardBackward(T* logits, const int32_t* labels, int64_t n, int64_t vocab, const double* row_scale,
                                   double grad_scale, double* device_sum) {
  std::vector<double> losses(n, 0.0);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * vocab;
    if (labels[i] < 0) {
      std::fill(row, row + vocab, T(0));
      continue;
    }
    losses[i] = CrossEntropyRow(row, labels[i], vocab, row_scale ? row_scale[i] * grad_scale : grad_scale);
  }
  return Delivered(InRowOrder(losses), device_sum);
}

template <typename T>
void TokenLogprobs(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) out[i] = labels[i] < 0 ? 0.0 : LogprobRow(logits + i * vocab, labels[i], vocab);
}

template <typename T>
void TokenArgmax(const T* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) out[i] = labels[i] < 0 ? -1 : ArgmaxRow(logits + i * vocab, vocab);
}

double CrossEntropyForwardBackwardBF16(uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab,
                                       const double* row_scale, double grad_scale, double* device_sum) {
  std::vector<double> losses(n, 0.0);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    uint16_t* row = logits + i * vocab;
    if (labels[i] < 0) {
      std::fill(row, row + vocab, uint16_t{0});
      continue;
    }
    float* wide = const_cast<float*>(Widened(row, vocab));
    losses[i] = CrossEntropyRow(wide, labels[i], vocab, row_scale ? row_scale[i] * grad_scale : grad_scale);
    F32ToBF16Row(wide, vocab, row);
  }
  return Delivered(InRowOrder(losses), device_sum);
}

void TokenLogprobsBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, double* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i)
    out[i] = labels[i] < 0 ? 0.0 : LogprobRow(Widened(logits + i * vocab, vocab), labels[i], vocab);
}

void TokenArgmaxBF16(const uint16_t* logits, const int32_t* labels, int64_t n, int64_t vocab, int32_t* out) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) out[i] = labels[i] < 0 ? -1 : ArgmaxRow(Widened(logits + i * vocab, vocab), vocab);
}

template double CrossEntropyForwardBackward<float>(float*, const int32_t*, int64_t, int64_t, const double*, double,
                                                   double*);
template double CrossEntropyForwardBackward<double>(double*, const int32_t*, int64_t, int64_t, const double*, double,
                                                    double*);
template void TokenLogprobs<float>(const float*, const int32_t*, int64_t, int64_t, double*);
template void TokenLogprobs<double>(const double*, const int32_t*, int64_t, int64_t, double*);
template void TokenArgmax<float>(const float*, const int32_t*, int64_t, int64_t, int32_t*);
template void TokenArgmax<double>(const double*, const int32_t*, int64_t, int64_t, int32_t*);

}  // namespace sg::cpu
