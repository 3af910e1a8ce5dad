// The vocabulary-parallel embedding and cross-entropy on the CPU (ops.inc's tensor-parallel block): the rows of
// a logits chunk that this rank holds, reduced to the per-row scalars the group all-reduces (core/lm_head.h).
// Everything is computed in double from the stored values, so the split sums are those of one process.
#include "kernels/cpu/vocab_parallel.h"

#include <cmath>
#include <type_traits>

#include "base/dtype.h"

namespace sg::cpu {
namespace {

double Get(const double* p, int64_t i) { return p[i]; }
double Get(const float* p, int64_t i) { return p[i]; }
double Get(const uint16_t* p, int64_t i) { return BF16ToF32(p[i]); }
void Set(double* p, int64_t i, double x) { p[i] = x; }
void Set(float* p, int64_t i, double x) { p[i] = static_cast<float>(x); }
void Set(uint16_t* p, int64_t i, double x) { p[i] = F32ToBF16(static_cast<float>(x)); }

// The row of id in a shard of `rows` rows starting at v0, or -1 when another rank holds it.
int64_t LocalRow(int32_t id, int64_t rows, int64_t v0) {
  const int64_t r = id - v0;
  return r >= 0 && r < rows ? r : -1;
}

// S: the table's storage (T or bf16); T: the output's.
template <typename S, typename T>
void EmbeddingShardForward(const int32_t* ids, int64_t n, const S* table, int64_t rows, int64_t v0, int64_t d, T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = LocalRow(ids[i], rows, v0);
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = r < 0 ? T(0) : static_cast<T>(Get(table, r * d + j));
  }
}

template <typename T>
void EmbeddingShardBackward(const int32_t* ids, int64_t n, const T* dout, int64_t rows, int64_t v0, int64_t d,
                            T* dtable) {
  for (int64_t i = 0; i < n; ++i)  // token order: a row's tokens add up as one process adds them
    if (const int64_t r = LocalRow(ids[i], rows, v0); r >= 0)
      for (int64_t j = 0; j < d; ++j) dtable[r * d + j] += dout[i * d + j];
}

template <typename S>
void VocabShardMax(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0, double* row_max,
                   int64_t* argmax) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    double best = -INFINITY;
    int64_t at = -1;
    if (labels[i] >= 0)
      for (int64_t v = 0; v < vocab; ++v)
        if (const double x = Get(logits, i * vocab + v); x > best) best = x, at = v;
    row_max[i] = best;
    argmax[i] = at < 0 ? -1 : v0 + at;
  }
}

template <typename S>
void VocabShardSums(const S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0, const double* row_max,
                    double* sums) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    sums[i] = sums[n + i] = 0;
    if (labels[i] < 0) continue;
    double s = 0;
    for (int64_t v = 0; v < vocab; ++v) s += std::exp(Get(logits, i * vocab + v) - row_max[i]);
    sums[i] = s;
    if (const int64_t l = LocalRow(labels[i], vocab, v0); l >= 0) sums[n + i] = Get(logits, i * vocab + l);
  }
}

template <typename S>
void VocabShardGradient(S* logits, const int32_t* labels, int64_t n, int64_t vocab, int64_t v0, const double* row_max,
                        const double* row_sum, const double* row_scale, double grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const bool labelled = labels[i] >= 0;
    const double s = labelled ? grad_scale * (row_scale ? row_scale[i] : 1.0) : 0.0;
    const int64_t l = labelled ? LocalRow(labels[i], vocab, v0) : -1;
    for (int64_t v = 0; v < vocab; ++v) {
      const double p = labelled ? std::exp(Get(logits, i * vocab + v) - row_max[i]) / row_sum[i] : 0.0;
      Set(logits, i * vocab + v, s * (p - (v == l ? 1.0 : 0.0)));
    }
  }
}

}  // namespace

template <typename T>
void AddVocabParallelOps(OpTable<T>& t) {
  t.embedding_shard_forward = EmbeddingShardForward<T, T>;
  t.embedding_shard_backward = EmbeddingShardBackward<T>;
  t.vocab_shard_max = VocabShardMax<T>;
  t.vocab_shard_sums = VocabShardSums<T>;
  t.vocab_shard_gradient = VocabShardGradient<T>;
  if constexpr (std::is_same_v<T, float>) {
    t.embedding_shard_forward_bf16 = EmbeddingShardForward<uint16_t, float>;
    t.vocab_shard_max_bf16 = VocabShardMax<uint16_t>;
    t.vocab_shard_sums_bf16 = VocabShardSums<uint16_t>;
    t.vocab_shard_gradient_bf16 = VocabShardGradient<uint16_t>;
  }
}

template void AddVocabParallelOps<float>(OpTable<float>&);
template void AddVocabParallelOps<double>(OpTable<double>&);

}  // namespace sg::cpu
