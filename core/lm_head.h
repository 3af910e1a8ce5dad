// Final RMSNorm + LM head + objective on a chunk, lm_chunk rows of logits at a time: the head every model family
// shares (Model::HeadLoss).
#pragma once

#include <algorithm>
#include <vector>

#include "core/model.h"
#include "core/objective.h"
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
  // --dtype=bf16 (bf16 head, T = float): the logits chunk is bf16 too; its products go through gemm_mixed (fp32
  // accumulation) and the loss kernels widen one row at a time.
  const bool bf16 = w.head.dtype == DType::kBF16;
  const DType f32 = DType::kF32, b16 = DType::kBF16;
  Tensor logits = Tensor::Empty(&mem, MemCategory::kLogits, bf16 ? b16 : dtype, {rows, V});
  uint16_t* logits16 = logits.data<uint16_t>();
  std::vector<double> logprobs(rows), row_scale(rows);
  const bool argmax = objective && objective->wants_argmax();
  std::vector<int32_t> argmax_ids(argmax ? rows : 0);
  for (int64_t i0 = 0; i0 < n; i0 += rows) {
    const int64_t m = std::min(rows, n - i0);
    const int64_t valid = std::count_if(labels + i0, labels + i0 + m, [](int32_t t) { return t >= 0; });
    if (valid == 0) continue;
    r.tokens += valid;
    const T* hn_i = hn.data<T>() + i0 * d;
    if (bf16) ops.gemm_mixed(false, true, m, V, d, 1.0f, f32, hn_i, d, b16, w.head.data, d, 0.0f, b16, logits16, V);
    else GemmWeight(ops, false, true, m, V, d, T(1), hn_i, d, w.head, d, T(0), logits.data<T>(), V);
    if (argmax) {
      if (bf16) ops.token_argmax_bf16(logits16, labels + i0, m, V, argmax_ids.data());
      else ops.token_argmax(logits.data<T>(), labels + i0, m, V, argmax_ids.data());
      for (int64_t j = 0; j < m; ++j)
        if (labels[i0 + j] >= 0) objective->Argmax(c.begin + i0 + j, argmax_ids[j]);
    }
    if (!need_grad || objective) {
      if (bf16) ops.token_logprobs_bf16(logits16, labels + i0, m, V, logprobs.data());
      else ops.token_logprobs(logits.data<T>(), labels + i0, m, V, logprobs.data());
      for (int64_t j = 0; j < m; ++j) {
        if (labels[i0 + j] < 0) continue;
        double dloss = -1;
        r.loss_sum += objective ? objective->Term(c.begin + i0 + j, logprobs[j], &dloss) : -logprobs[j];
        row_scale[j] = -dloss;  // d f / d logits = f'(logp) (onehot - softmax)
      }
      if (!need_grad) continue;
      if (bf16) ops.cross_entropy_bf16(logits16, labels + i0, m, V, row_scale.data(), grad_scale);
      else ops.cross_entropy_forward_backward(logits.data<T>(), labels + i0, m, V, row_scale.data(), grad_scale);
    } else {
      r.loss_sum += bf16 ? ops.cross_entropy_bf16(logits16, labels + i0, m, V, nullptr, grad_scale)
                         : ops.cross_entropy_forward_backward(logits.data<T>(), labels + i0, m, V, nullptr, grad_scale);
    }
    T* dhn_i = dhn.data<T>() + i0 * d;
    if (bf16) {
      if (w.head_grad)
        ops.gemm_mixed(true, false, V, d, m, 1.0f, b16, logits16, V, f32, hn_i, d, 1.0f, f32, w.head_grad, d);
      ops.gemm_mixed(false, false, m, d, V, 1.0f, b16, logits16, V, b16, w.head.data, d, 0.0f, f32, dhn_i, d);
      continue;
    }
    if (w.head_grad) ops.gemm(true, false, V, d, m, T(1), logits.data<T>(), V, hn_i, d, T(1), w.head_grad, d);
    GemmWeight(ops, false, false, m, d, V, T(1), logits.data<T>(), V, w.head, d, T(0), dhn_i, d);
  }
  if (need_grad) {
    r.dh = Tensor::Empty(&mem, MemCategory::kActivations, dtype, {n, d});
    ops.rmsnorm_backward(dhn.data<T>(), h_in.data<T>(), w.norm, rstd.data<T>(), n, d, r.dh.data<T>(), w.norm_grad,
                         false);
  }
  return r;
}

}  // namespace sg
