#include "core/trainer.h"

#include <cmath>
#include <exception>

#include "absl/strings/str_cat.h"
#include "core/data.h"
#include "kernels/backend.h"

namespace sg {

namespace {
// A distinct, reproducible sampling seed per (user seed, call, sequence).
uint64_t SequenceSeed(uint64_t seed, uint64_t call, uint64_t index) {
  uint64_t h = seed ^ 0x243F6A8885A308D3ull;
  for (uint64_t v : {call, index}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
  }
  return h;
}
}  // namespace

Trainer::Trainer(Model& model, StrategyOptions strategy, OptimizerOptions optimizer)
    : model_(model), strategy_options_(std::move(strategy)), opt_(optimizer) {
  if (absl::StatusOr<StrategyFn> fn = FindStrategy(strategy_options_.name); fn.ok()) strategy_ = *fn;
}

absl::StatusOr<int64_t> Trainer::ValidateBatch(const std::vector<Sequence>& batch) const {
  if (absl::Status s = ValidateStrategyOptions(strategy_options_); !s.ok()) return s;
  if (batch.empty()) return absl::InvalidArgumentError("batch is empty");
  int64_t valid = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const std::string what = absl::StrCat("batch sequence ", i);
    if (absl::Status s = ValidateSequence(batch[i], model_.vocab_size(), what); !s.ok()) return s;
    if (absl::Status s = ValidateSpacoBudget(strategy_options_, static_cast<int64_t>(batch[i].ids.size()), what);
        !s.ok())
      return s;
    for (int32_t l : batch[i].labels) valid += l >= 0;
  }
  if (valid == 0) return absl::InvalidArgumentError("batch has no valid labels (all are -100): the loss is undefined");
  return valid;
}

absl::StatusOr<StepMetrics> Trainer::EvaluateLoss(const std::vector<Sequence>& batch) {
  absl::StatusOr<int64_t> valid = ValidateBatch(batch);
  if (!valid.ok()) return valid.status();
  StepMetrics m;
  try {
    for (const Sequence& seq : batch) {
      const GradResult r = sg::EvaluateLoss(model_, seq, strategy_options_);
      m.loss += r.loss_sum;
      m.tokens += r.tokens;
      m.chunks += r.chunks;
    }
  } catch (const Cancelled&) {
    return absl::CancelledError("evaluation cancelled");
  } catch (const MemoryLimitExceeded& e) {
    return absl::ResourceExhaustedError(e.what());
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("evaluation failed: ", e.what()));
  }
  m.loss /= static_cast<double>(*valid);
  return m;
}

absl::StatusOr<StepMetrics> Trainer::ComputeGradients(const std::vector<Sequence>& batch) {
  absl::StatusOr<int64_t> checked = ValidateBatch(batch);
  if (!checked.ok()) return checked.status();
  const int64_t valid = *checked;

  StepMetrics m;
  ZeroGrads(model_);
  const uint64_t call = calls_++;
  try {
    for (size_t i = 0; i < batch.size(); ++i) {
      StrategyOptions o = strategy_options_;
      o.seed = SequenceSeed(strategy_options_.seed, call, i);
      GradResult r = strategy_(model_, batch[i], 1.0 / static_cast<double>(valid), o);
      m.loss += r.loss_sum;
      m.tokens += r.tokens;
      m.chunks += r.chunks;
      m.chunks_backpropagated += r.chunks_backpropagated;
    }
  } catch (const Cancelled&) {
    return absl::CancelledError(absl::StrCat("step ", step_ + 1, " cancelled"));
  } catch (const MemoryLimitExceeded& e) {
    return absl::ResourceExhaustedError(e.what());
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("strategy '", strategy_options_.name, "' failed: ", e.what()));
  }
  m.loss /= static_cast<double>(valid);
  if (!std::isfinite(m.loss)) return absl::InternalError(absl::StrCat("loss is ", m.loss, " at step ", step_ + 1));
  return m;
}

namespace {
template <typename T>
double SumSquares(const Tensor& t) {
  double s = 0;
  const T* p = t.data<T>();
  for (int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}
template <typename T>
void Scale(Tensor& t, double f) {
  T* p = t.data<T>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<T>(p[i] * f);
}
template <typename T>
void Adam(const OptimizerOptions& o, std::vector<Param>& params, std::vector<Tensor>& m, std::vector<Tensor>& v,
          int64_t step) {
  const OpTable<T>& ops = CpuOps<T>();
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    if (!p.grad.defined()) continue;
    // Norm weights and biases are not decayed.
    const double wd = p.value.shape().size() >= 2 ? o.weight_decay : 0.0;
    ops.adamw(p.value.data<T>(), p.grad.data<T>(), m[i].data<T>(), v[i].data<T>(), p.value.numel(), o.lr, o.beta1,
              o.beta2, o.eps, wd, step);
  }
}
}  // namespace

absl::Status Trainer::OptimizerStep(StepMetrics* metrics) {
  std::vector<Param>& params = model_.params();
  const bool f64 = model_.dtype() == DType::kF64;
  double sq = 0;
  for (Param& p : params) {
    if (!p.grad.defined()) continue;
    const double s = f64 ? SumSquares<double>(p.grad) : SumSquares<float>(p.grad);
    if (!std::isfinite(s))
      return absl::InternalError(absl::StrCat("gradient of '", p.name, "' is not finite at step ", step_ + 1));
    sq += s;
  }
  const double norm = std::sqrt(sq);
  if (metrics) metrics->grad_norm = norm;
  if (opt_.clip_grad_norm > 0 && norm > opt_.clip_grad_norm) {
    for (Param& p : params) {
      if (!p.grad.defined()) continue;
      if (f64) Scale<double>(p.grad, opt_.clip_grad_norm / norm);
      else Scale<float>(p.grad, opt_.clip_grad_norm / norm);
    }
  }
  if (m_.empty()) {
    for (Param& p : params) {
      if (!p.grad.defined()) {
        m_.emplace_back();
        v_.emplace_back();
        continue;
      }
      m_.push_back(Tensor::Zeros(&model_.memory(), MemCategory::kOptimizer, p.value.dtype(), p.value.shape()));
      v_.push_back(Tensor::Zeros(&model_.memory(), MemCategory::kOptimizer, p.value.dtype(), p.value.shape()));
    }
  }
  ++step_;
  if (f64) Adam<double>(opt_, params, m_, v_, step_);
  else Adam<float>(opt_, params, m_, v_, step_);
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> Trainer::Step(const std::vector<Sequence>& batch) {
  absl::StatusOr<StepMetrics> m = ComputeGradients(batch);
  if (!m.ok()) return m.status();
  if (absl::Status s = OptimizerStep(&*m); !s.ok()) return s;
  return m;
}

}  // namespace sg
