#include "core/objective.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace sg {

absl::Status ValidateObjectiveOptions(const ObjectiveOptions& o) {
  if (o.name != "sft" && o.name != "dpo" && o.name != "grpo")
    return absl::InvalidArgumentError(absl::StrCat("--objective: unknown objective '", o.name, "' (sft, dpo, grpo)"));
  if (!(o.dpo_beta > 0)) return absl::InvalidArgumentError(absl::StrCat("--dpo_beta must be positive, got ", o.dpo_beta));
  if (!(o.grpo_clip_eps > 0 && o.grpo_clip_eps < 1))
    return absl::InvalidArgumentError(absl::StrCat("--grpo_clip_eps must be in (0, 1), got ", o.grpo_clip_eps));
  if (!(o.grpo_kl_beta >= 0))
    return absl::InvalidArgumentError(absl::StrCat("--grpo_kl_beta must be >= 0, got ", o.grpo_kl_beta));
  return absl::OkStatus();
}

namespace {

class Linear final : public TokenObjective {
 public:
  explicit Linear(double c) : c_(c) {}
  double Term(int64_t, double logp, double* dloss) const override {
    *dloss = c_;
    return c_ * logp;
  }

 private:
  double c_;
};

class Recording final : public TokenObjective {
 public:
  explicit Recording(std::vector<double>* out) : out_(out) {}
  double Term(int64_t t, double logp, double* dloss) const override {
    (*out_)[t] = logp;
    *dloss = -1;
    return -logp;
  }

 private:
  std::vector<double>* out_;
};

class Grpo final : public TokenObjective {
 public:
  Grpo(const GrpoCompletion& c, std::vector<double> ref, const ObjectiveOptions& o, double scale)
      : old_(c.old_logprobs), ref_(std::move(ref)), advantage_(c.advantage), eps_(o.grpo_clip_eps),
        beta_(o.grpo_kl_beta), bias_correction_(o.grpo_kl_bias_correction), scale_(scale) {}

  double Term(int64_t t, double logp, double* dloss) const override {
    // Clipped surrogate: with old = the current policy (no old log-probs given), r = 1 and dr/dlogp = 1.
    const double old = old_.empty() ? logp : old_[t];
    const double r = std::exp(logp - old);
    const double clipped = std::clamp(r, 1 - eps_, 1 + eps_);
    const bool flat = r * advantage_ > clipped * advantage_;  // min() picks the clipped, constant branch
    double f = -std::min(r * advantage_, clipped * advantage_);
    double df = flat ? 0.0 : -r * advantage_;
    if (beta_ > 0) {  // k3 estimator of KL(pi || ref): e^x - x - 1 with x = ref - logp
      const double x = ref_[t] - logp;
      const double k3 = std::exp(x) - x - 1, dk3 = 1 - std::exp(x);
      // Bias-corrected: r k3, whose derivative r k3 + r dk3 is -r x.
      f += beta_ * (bias_correction_ ? r * k3 : k3);
      df += beta_ * (bias_correction_ ? -r * x : dk3);
    }
    *dloss = scale_ * df;
    return scale_ * f;
  }

 private:
  std::vector<double> old_, ref_;
  double advantage_, eps_, beta_;
  bool bias_correction_;
  double scale_;
};

}  // namespace

std::shared_ptr<const TokenObjective> LinearObjective(double c) { return std::make_shared<Linear>(c); }
std::shared_ptr<const TokenObjective> RecordingObjective(std::vector<double>* out) {
  return std::make_shared<Recording>(out);
}
std::shared_ptr<const TokenObjective> GrpoObjective(const GrpoCompletion& c, std::vector<double> ref,
                                                    const ObjectiveOptions& o, double scale) {
  return std::make_shared<Grpo>(c, std::move(ref), o, scale);
}

}  // namespace sg
