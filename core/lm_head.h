// Final RMSNorm + LM head + objective on a chunk, lm_chunk rows of logits at a time: the head every model family
// shares (Model::HeadLoss).
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/model.h"
#include "core/objective.h"
#include "core/tensor_parallel.h"
#include "kernels/backend.h"

namespace sg {

template <typename T>
struct LmHeadWeights {
  const T* norm = nullptr;  // final norm weight [d]
  T* norm_grad = nullptr;   // where its gradient goes (never null when need_grad)
  WeightView head;          // [vocab][d]
  T* head_grad = nullptr;   // null when frozen
  double eps = 1e-6;
  int64_t d = 0, vocab = 0, lm_chunk = 256;
  double logit_scale = 1.0;  // logits = logit_scale (head hn): Falcon-H1's lm_head_multiplier
  // Vocabulary-parallel head: `head` holds rows [rank vocab, (rank + 1) vocab) of the group's vocabulary.
  const TensorParallel* vocab_parallel = nullptr;
};

// The cross-entropy of a logits chunk [m][V] of which this rank holds the columns [v0, v0 + V) (T, or bf16 as
// uint16_t), without any rank holding a whole row: the backend's vocab_shard_* ops reduce the chunk on its device
// to per-row scalars, and only those are reduced over the group: the maximum, then the sum of exponentials and the
// label's logit (two all-reduces of m and 2m scalars, three with argmax).
template <typename T, typename L>
class VocabParallelRows {
 public:
  VocabParallelRows(const OpTable<T>& ops, L* logits, const int32_t* labels, int64_t m, int64_t V,
                    const TensorParallel& tp)
      : ops_(ops), logits_(logits), labels_(labels), m_(m), V_(V), v0_(tp.rank * V), tp_(tp), max_(m), sums_(2 * m) {}
  // logp[j] of every labelled row; argmax (if not null) gets the lowest id of the largest logit (NaN never wins).
  void Logprobs(double* logp, int32_t* argmax) {
    std::vector<int64_t> best(m_);
    if constexpr (std::is_same_v<L, uint16_t>)
      ops_.vocab_shard_max_bf16(logits_, labels_, m_, V_, v0_, max_.data(), best.data());
    else ops_.vocab_shard_max(logits_, labels_, m_, V_, v0_, max_.data(), best.data());
    const std::vector<double> local_max = max_;
    tp_.AllReduceHost(max_.data(), m_, DType::kF64, dist::ReduceOp::kMax);
    if constexpr (std::is_same_v<L, uint16_t>)
      ops_.vocab_shard_sums_bf16(logits_, labels_, m_, V_, v0_, max_.data(), sums_.data());
    else ops_.vocab_shard_sums(logits_, labels_, m_, V_, v0_, max_.data(), sums_.data());
    tp_.AllReduceHost(sums_.data(), 2 * m_, DType::kF64);
    for (int64_t j = 0; j < m_; ++j) logp[j] = labels_[j] < 0 ? 0.0 : sums_[m_ + j] - max_[j] - std::log(sums_[j]);
    if (!argmax) return;
    std::vector<int64_t> id(m_, INT64_MAX);  // the ranks whose shard holds the row's maximum offer their column
    for (int64_t j = 0; j < m_; ++j)
      if (labels_[j] >= 0 && best[j] >= 0 && local_max[j] == max_[j]) id[j] = best[j];
    tp_.AllReduceHost(id.data(), m_, DType::kI64, dist::ReduceOp::kMin);
    for (int64_t j = 0; j < m_; ++j) argmax[j] = labels_[j] < 0 ? -1 : static_cast<int32_t>(id[j]);
  }
  // After Logprobs: the chunk becomes grad_scale row_scale[j] (softmax - onehot(label)) (rows without a label: 0).
  void Gradient(const double* row_scale, double grad_scale) {
    if constexpr (std::is_same_v<L, uint16_t>)
      ops_.vocab_shard_gradient_bf16(logits_, labels_, m_, V_, v0_, max_.data(), sums_.data(), row_scale, grad_scale);
    else ops_.vocab_shard_gradient(logits_, labels_, m_, V_, v0_, max_.data(), sums_.data(), row_scale, grad_scale);
  }

 private:
  const OpTable<T>& ops_;
  L* logits_;
  const int32_t* labels_;
  int64_t m_, V_, v0_;
  const TensorParallel& tp_;
  std::vector<double> max_, sums_;  // per row: max; sum of exp(x - max), then the label's logit
};

template <typename T>
HeadResult LmHeadLoss(const OpTable<T>& ops, MemoryTracker& mem, DType dtype, const LmHeadWeights<T>& w, Chunk c,
                      const Tensor& h_in, const int32_t* labels_all, const TokenObjective* objective,
                      double grad_scale, bool need_grad) {
  const int64_t n = c.size(), d = w.d, V = w.vocab;
  const int32_t* labels = labels_all + c.begin;
  HeadResult r;
  Tensor hn = Tensor::Empty(&mem, MemCategory::kWorkspace, dtype, {n, d});
  Tensor rstd = Tensor::Empty(&mem, MemCategory::kWorkspace, dtype, {n});
  ops.rmsnorm_forward(h_in.data<T>(), w.norm, n, d, w.eps, hn.data<T>(), rstd.data<T>());
  Tensor dhn;
  if (need_grad) dhn = Tensor::Zeros(&mem, MemCategory::kWorkspace, dtype, {n, d});
  const int64_t rows = std::min(w.lm_chunk, n);
  // bf16 storage (bf16 head, T = float): the logits chunk is bf16 too; its products go through gemm_mixed (fp32
  // accumulation) and the loss kernels widen one row at a time.
  const bool bf16 = w.head.dtype == DType::kBF16;
  const DType f32 = DType::kF32, b16 = DType::kBF16;
  Tensor logits = Tensor::Empty(&mem, MemCategory::kLogits, bf16 ? b16 : dtype, {rows, V});
  uint16_t* logits16 = logits.data<uint16_t>();
  std::vector<double> logprobs(rows), row_scale(rows);
  double* device_loss = nullptr;  // the chunk's token cross-entropy, in device memory
  const bool argmax = objective && objective->wants_argmax();
  std::vector<int32_t> argmax_ids(argmax ? rows : 0);
  const TensorParallel* tp = w.vocab_parallel && w.vocab_parallel->on() ? w.vocab_parallel : nullptr;
  const bool values = mem.device() != Device::kMeta;  // meta tensors hold no values
  const T scale = T(w.logit_scale);  // the logits' factor, so also their gradient's
  const float scale_f = static_cast<float>(w.logit_scale);
  // The objective's terms of rows [i0, i0 + m) from their log-probs, and the factor each row's logit gradient gets.
  auto add_terms = [&](int64_t i0, int64_t m) {
    for (int64_t j = 0; j < m; ++j) {
      if (labels[i0 + j] < 0) continue;
      double dloss = -1;
      r.loss_sum += objective ? objective->Term(c.begin + i0 + j, logprobs[j], &dloss) : -logprobs[j];
      row_scale[j] = -dloss;  // d f / d logits = f'(logp) (onehot - softmax)
    }
  };
  for (int64_t i0 = 0; i0 < n; i0 += rows) {
    const int64_t m = std::min(rows, n - i0);
    const int64_t valid = std::count_if(labels + i0, labels + i0 + m, [](int32_t t) { return t >= 0; });
    if (valid == 0) continue;
    r.tokens += valid;
    const T* hn_i = hn.data<T>() + i0 * d;
    if (bf16) ops.gemm_mixed(false, true, m, V, d, scale_f, f32, hn_i, d, b16, w.head.data, d, 0.0f, b16, logits16, V);
    else GemmWeight(ops, false, true, m, V, d, scale, hn_i, d, w.head, d, T(0), logits.data<T>(), V);
    if (tp && values) {  // the vocabulary is split: this rank's columns of the chunk become their gradient
      auto rows_of = [&](auto* l) {
        VocabParallelRows<T, std::remove_pointer_t<decltype(l)>> rows_tp(ops, l, labels + i0, m, V, *tp);
        rows_tp.Logprobs(logprobs.data(), argmax ? argmax_ids.data() : nullptr);
        for (int64_t j = 0; j < m && argmax; ++j)
          if (labels[i0 + j] >= 0) objective->Argmax(c.begin + i0 + j, argmax_ids[j]);
        add_terms(i0, m);
        if (need_grad) rows_tp.Gradient(row_scale.data(), grad_scale);
      };
      if (bf16) rows_of(logits16);
      else rows_of(logits.data<T>());
      if (!need_grad) continue;
    } else {
      if (argmax) {
        if (bf16) ops.token_argmax_bf16(logits16, labels + i0, m, V, argmax_ids.data());
        else ops.token_argmax(logits.data<T>(), labels + i0, m, V, argmax_ids.data());
        for (int64_t j = 0; j < m; ++j)
          if (labels[i0 + j] >= 0) objective->Argmax(c.begin + i0 + j, argmax_ids[j]);
      }
      if (!need_grad || objective) {
        if (bf16) ops.token_logprobs_bf16(logits16, labels + i0, m, V, logprobs.data());
        else ops.token_logprobs(logits.data<T>(), labels + i0, m, V, logprobs.data());
        add_terms(i0, m);
        if (!need_grad) continue;
        if (bf16) ops.cross_entropy_bf16(logits16, labels + i0, m, V, row_scale.data(), grad_scale, nullptr);
        else ops.cross_entropy_forward_backward(logits.data<T>(), labels + i0, m, V, row_scale.data(), grad_scale,
                                                nullptr);
      } else {
        // Token cross-entropy: the chunk's loss stays on the device (one double, read at the step's end), so no
        // chunk waits for it.
        if (!device_loss) device_loss = r.loss_sum.NewPartial(mem.device());
        if (bf16) ops.cross_entropy_bf16(logits16, labels + i0, m, V, nullptr, grad_scale, device_loss);
        else ops.cross_entropy_forward_backward(logits.data<T>(), labels + i0, m, V, nullptr, grad_scale, device_loss);
      }
    }
    T* dhn_i = dhn.data<T>() + i0 * d;
    if (bf16) {
      if (w.head_grad)
        ops.gemm_mixed(true, false, V, d, m, scale_f, b16, logits16, V, f32, hn_i, d, 1.0f, f32, w.head_grad, d);
      ops.gemm_mixed(false, false, m, d, V, scale_f, b16, logits16, V, b16, w.head.data, d, 0.0f, f32, dhn_i, d);
      continue;
    }
    if (w.head_grad) ops.gemm(true, false, V, d, m, scale, logits.data<T>(), V, hn_i, d, T(1), w.head_grad, d);
    GemmWeight(ops, false, false, m, d, V, scale, logits.data<T>(), V, w.head, d, T(0), dhn_i, d);
  }
  if (need_grad) {
    if (tp) tp->AllReduce(dhn.raw(), n * d, dtype);  // each rank's vocabulary rows gave part of it
    r.dh = Tensor::Empty(&mem, MemCategory::kActivations, dtype, {n, d});
    ops.rmsnorm_backward(dhn.data<T>(), h_in.data<T>(), w.norm, rstd.data<T>(), n, d, r.dh.data<T>(), w.norm_grad,
                         false);
  }
  return r;
}

}  // namespace sg
