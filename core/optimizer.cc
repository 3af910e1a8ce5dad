#include "core/optimizer.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "core/lr_schedule.h"
#include "kernels/backend.h"

namespace sg {

absl::Status ValidateOptimizerOptions(const OptimizerOptions& o) {
  auto bad = [](const char* field, double v, const char* need) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", v, "; need ", need));
  };
  if (!(o.lr > 0 && std::isfinite(o.lr))) return bad("lr", o.lr, "a finite value > 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return bad("beta1", o.beta1, "[0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return bad("beta2", o.beta2, "[0, 1)");
  if (!(o.eps > 0 && std::isfinite(o.eps))) return bad("eps", o.eps, "a finite value > 0");
  if (!(o.weight_decay >= 0 && std::isfinite(o.weight_decay))) return bad("weight_decay", o.weight_decay, ">= 0");
  if (!(o.clip_grad_norm >= 0 && std::isfinite(o.clip_grad_norm)))
    return bad("clip_grad_norm", o.clip_grad_norm, ">= 0 (0 = no clipping)");
  if (o.grad_accum < 1)
    return absl::InvalidArgumentError(absl::StrCat("grad_accum is ", o.grad_accum, "; need >= 1 micro-batch"));
  return ValidateLrSchedule(o);
}

namespace {
template <typename T>
double SumSquares(const Tensor& t, MemoryTracker& mem) {
  double s = 0;
  if (t.device() == Device::kMeta) return s;  // meta tensors hold no values: finite, zero
  if (!HostAddressable(t.device())) {
    // On the device: dot products t . t by the backend's GEMM in pieces that fit its int sizes, one number each
    // brought back (not the gradient).
    constexpr int64_t kPiece = int64_t{1} << 28;
    const int64_t pieces = (t.numel() + kPiece - 1) / kPiece;
    Tensor dots = Tensor::Empty(&mem, MemCategory::kWorkspace, t.dtype(), {pieces});
    const OpTable<T>& ops = OpsFor<T>(t.device());
    for (int64_t i = 0; i < pieces; ++i) {
      const int64_t k = std::min(kPiece, t.numel() - i * kPiece);
      const T* x = t.data<T>() + i * kPiece;
      ops.gemm(false, true, 1, 1, k, T(1), x, k, x, k, T(0), dots.data<T>() + i, 1);
    }
    for (T d : HostCopy<T>(dots)) s += static_cast<double>(d);
    return s;
  }
  const T* p = t.data<T>();
  for (int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}
template <typename T>
int64_t FirstNonFinite(const Tensor& t, double* value) {
  if (t.device() == Device::kMeta) return -1;
  std::vector<T> copy;
  const T* p = HostReadable(t.device(), t.data<T>(), t.numel(), &copy);
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(static_cast<double>(p[i]))) {
      *value = static_cast<double>(p[i]);
      return i;
    }
  return -1;
}
int64_t FirstNonFiniteBF16(const Tensor& t, double* value) {
  if (t.device() == Device::kMeta) return -1;
  std::vector<uint16_t> copy;
  const uint16_t* p = HostReadable(t.device(), t.data<uint16_t>(), t.numel(), &copy);
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(BF16ToF32(p[i]))) {
      *value = BF16ToF32(p[i]);
      return i;
    }
  return -1;
}
template <typename T>
void Scale(Tensor& t, double f) {
  if (t.device() == Device::kMeta) return;
  if (!HostAddressable(t.device())) return OpsFor<T>(t.device()).scale(t.data<T>(), t.numel(), f);
  T* p = t.data<T>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<T>(p[i] * f);
}
template <typename T>
void Adam(const OpTable<T>& ops, const OptimizerOptions& o, double lr, std::vector<Param>& params,
          std::vector<Tensor>& master, std::vector<Tensor>& m, std::vector<Tensor>& v, int64_t step) {
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    if (!p.grad.defined()) continue;
    // Norm weights and biases are not decayed.
    const double wd = p.value.shape().size() >= 2 ? o.weight_decay : 0.0;
    if (master[i].defined()) {
      if constexpr (std::is_same_v<T, float>)
        ops.adamw_bf16(p.value.data<uint16_t>(), master[i].data<float>(), p.grad.data<float>(), m[i].data<float>(),
                       v[i].data<float>(), p.value.numel(), lr, o.beta1, o.beta2, o.eps, wd, step);
      continue;
    }
    ops.adamw(p.value.data<T>(), p.grad.data<T>(), m[i].data<T>(), v[i].data<T>(), p.value.numel(), lr, o.beta1,
              o.beta2, o.eps, wd, step);
  }
}
// A trainable parameter stored in bf16 is stepped through an fp32 master copy (counted as optimizer state).
bool NeedsMaster(const Param& p) { return p.grad.defined() && p.value.dtype() == DType::kBF16; }
}  // namespace

absl::StatusOr<double> GradSquaredNorm(Model& model, const std::string& when) {
  const bool f64 = model.dtype() == DType::kF64;
  double sq = 0;
  for (Param& p : model.params()) {
    if (!p.grad.defined()) continue;
    const double s = f64 ? SumSquares<double>(p.grad, model.memory()) : SumSquares<float>(p.grad, model.memory());
    if (!std::isfinite(s)) {
      double value = 0;
      const int64_t at = f64 ? FirstNonFinite<double>(p.grad, &value) : FirstNonFinite<float>(p.grad, &value);
      if (at < 0)  // finite elements whose squares overflow
        return absl::InternalError(absl::StrCat("gradient of '", p.name, "' overflows (sum of squares ", s, ") ",
                                                  when));
      return absl::InternalError(absl::StrCat("gradient of '", p.name, "' is not finite ", when, ": element ", at,
                                                " of ", p.grad.numel(), " is ", value));
    }
    sq += s;
  }
  return sq;
}

std::string NonFiniteWeightsNote(Model& model) {
  for (Param& p : model.params()) {
    double value = 0;
    const int64_t at = p.value.dtype() == DType::kF64    ? FirstNonFinite<double>(p.value, &value)
                       : p.value.dtype() == DType::kBF16 ? FirstNonFiniteBF16(p.value, &value)
                                                         : FirstNonFinite<float>(p.value, &value);
    if (at >= 0) return absl::StrCat("; parameter '", p.name, "' holds ", value, " at element ", at);
  }
  return "";
}

void ScaleGrads(Model& model, double factor) {
  const bool f64 = model.dtype() == DType::kF64;
  for (Param& p : model.params()) {
    if (!p.grad.defined()) continue;
    if (f64) Scale<double>(p.grad, factor);
    else Scale<float>(p.grad, factor);
  }
}

int64_t AdamW::StateBytes(Model& model) {
  int64_t bytes = 0;
  for (Param& p : model.params())
    if (p.grad.defined()) bytes += (NeedsMaster(p) ? 3 : 2) * static_cast<int64_t>(p.grad.nbytes());
  return bytes;
}

absl::Status AdamW::EnsureMoments(Model& model) {
  if (!m_.empty()) return absl::OkStatus();
  std::vector<Tensor> master, m, v;  // all of the state or none: a failed allocation leaves it as it was
  try {
    for (Param& p : model.params()) {
      master.emplace_back();
      if (!p.grad.defined()) {
        m.emplace_back();
        v.emplace_back();
        continue;
      }
      m.push_back(Tensor::Zeros(&model.memory(), MemCategory::kOptimizer, p.grad.dtype(), p.grad.shape()));
      v.push_back(Tensor::Zeros(&model.memory(), MemCategory::kOptimizer, p.grad.dtype(), p.grad.shape()));
      if (NeedsMaster(p))
        master.back() = Tensor::Empty(&model.memory(), MemCategory::kMasterWeights, DType::kF32, p.value.shape());
    }
  } catch (const MemoryLimitExceeded& e) {
    return absl::ResourceExhaustedError(absl::StrCat("optimizer state: ", e.what()));
  }
  master_ = std::move(master);
  m_ = std::move(m);
  v_ = std::move(v);
  RefreshMasters(model);
  return absl::OkStatus();
}

void AdamW::RefreshMasters(Model& model) {
  std::vector<Param>& params = model.params();
  for (size_t i = 0; i < master_.size() && i < params.size(); ++i)
    if (master_[i].defined())
      OpsFor<float>(model.memory().device())
          .bf16_to_f32(params[i].value.data<uint16_t>(), params[i].value.numel(), master_[i].data<float>());
}

absl::Status AdamW::Step(Model& model, const OptimizerOptions& o, double lr) {
  if (absl::Status s = EnsureMoments(model); !s.ok()) return s;
  std::vector<Param>& params = model.params();
  if (params.size() != m_.size())
    return absl::FailedPreconditionError(absl::StrCat("optimizer state holds ", m_.size(),
                                                      " parameters but the model has ", params.size()));
  ++step_;
  const Device device = model.memory().device();
  if (model.dtype() == DType::kF64) Adam<double>(OpsFor<double>(device), o, lr, params, master_, m_, v_, step_);
  else Adam<float>(OpsFor<float>(device), o, lr, params, master_, m_, v_, step_);
  return absl::OkStatus();
}

}  // namespace sg
