// What every model family keeps the same way: parameters under their Hugging Face names (with gradients), the
// tracker their memory is counted by, tensor allocation, and the chunked LM head over a final norm and a head
// matrix. A model class derives from Model's family interface and from ParamStore<T>.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "core/lm_head.h"

namespace sg {

template <typename T>
class ParamStore {
 protected:
  static constexpr DType kDType = std::is_same_v<T, double> ? DType::kF64 : DType::kF32;

  int Add(const std::string& name, std::vector<int64_t> shape) {
    Param p;
    p.name = name;
    p.value = Tensor::Zeros(&mem_, MemCategory::kWeights, kDType, shape);
    p.grad = Tensor::Zeros(&mem_, MemCategory::kGrads, kDType, shape);
    params_.push_back(std::move(p));
    return static_cast<int>(params_.size()) - 1;
  }
  Tensor New(MemCategory cat, std::vector<int64_t> shape) { return Tensor::Empty(&mem_, cat, kDType, shape); }
  T* W(int idx) const { return params_[idx].value.template data<T>(); }
  T* G(int idx) const { return params_[idx].grad.defined() ? params_[idx].grad.template data<T>() : nullptr; }
  // Frozen parameters still need somewhere for a kernel to write their gradient (one buffer per parameter, so
  // that two of them can be written by one call).
  T* GradOrScratch(int idx) {
    if (T* g = G(idx)) return g;
    std::vector<T>& buf = scratch_[idx];
    buf.assign(params_[idx].value.numel(), T(0));
    return buf.data();
  }
  void SetLmChunk(int64_t rows) { lm_chunk_ = std::max<int64_t>(1, rows); }

  // Final norm (parameter final_norm, epsilon eps) + LM head (parameter head, [vocab][d]) + objective on chunk c.
  HeadResult Head(const OpTable<T>& ops, int final_norm, int head, double eps, int64_t d, int64_t vocab, Chunk c,
                  const Tensor& h, const int32_t* labels, const TokenObjective* objective, double grad_scale,
                  bool need_grad) {
    LmHeadWeights<T> w;
    w.norm = W(final_norm);
    w.norm_grad = need_grad ? GradOrScratch(final_norm) : nullptr;
    w.head = W(head);
    w.head_grad = G(head);
    w.eps = eps;
    w.d = d;
    w.vocab = vocab;
    w.lm_chunk = lm_chunk_;
    return LmHeadLoss<T>(ops, mem_, kDType, w, c, h, labels, objective, grad_scale, need_grad);
  }

  MemoryTracker mem_;
  std::vector<Param> params_;
  int64_t lm_chunk_ = 256;
  std::map<int, std::vector<T>> scratch_;
};

}  // namespace sg
