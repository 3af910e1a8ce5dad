#include "core/gradcheck.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::vector<std::vector<double>> CopyGrads(Model& model) {
  std::vector<std::vector<double>> out;
  for (Param& p : model.params()) {
    std::vector<double> g(p.grad.defined() ? p.grad.numel() : 0);
    for (size_t i = 0; i < g.size(); ++i)
      g[i] = model.dtype() == DType::kF64 ? p.grad.data<double>()[i] : p.grad.data<float>()[i];
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace

absl::StatusOr<GradCheckResult> CheckAgainstFull(Model& model, const std::vector<Sequence>& batch,
                                                 const StrategyOptions& strategy, int64_t samples) {
  Batch b;
  b.sequences = batch;
  return CheckAgainstFull(model, b, strategy, ObjectiveOptions{}, samples);
}

absl::StatusOr<GradCheckResult> CheckAgainstFull(Model& model, const Batch& batch, const StrategyOptions& strategy,
                                                 const ObjectiveOptions& objective, int64_t samples) {
  if (samples < 1) return absl::InvalidArgumentError(absl::StrCat("--samples must be at least 1, got ", samples));
  StrategyOptions full = strategy;
  full.name = "full";
  Trainer reference(model, full, {}, objective);
  absl::StatusOr<StepMetrics> ref = reference.ComputeGradients(batch);
  if (!ref.ok()) return ref.status();
  const std::vector<std::vector<double>> expected = CopyGrads(model);

  Trainer trainer(model, strategy, {}, objective);
  std::vector<std::vector<double>> actual;
  GradCheckResult r;
  for (int64_t n = 0; n < samples; ++n) {
    absl::StatusOr<StepMetrics> got = trainer.ComputeGradients(batch);
    if (!got.ok()) return got.status();
    r.loss = got->loss;
    const std::vector<std::vector<double>> g = CopyGrads(model);
    if (actual.empty()) actual.assign(g.size(), {});
    for (size_t i = 0; i < g.size(); ++i) {
      actual[i].resize(g[i].size());
      for (size_t j = 0; j < g[i].size(); ++j) actual[i][j] += g[i][j] / static_cast<double>(samples);
    }
  }

  r.samples = samples;
  r.reference_loss = ref->loss;
  double diff_sq = 0, ref_sq = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i].empty()) continue;
    double err = 0, scale = 1e-300;
    for (size_t j = 0; j < expected[i].size(); ++j) {
      err = std::max(err, std::abs(actual[i][j] - expected[i][j]));
      scale = std::max(scale, std::abs(expected[i][j]));
      diff_sq += (actual[i][j] - expected[i][j]) * (actual[i][j] - expected[i][j]);
      ref_sq += expected[i][j] * expected[i][j];
    }
    ++r.params_checked;
    r.max_abs_err = std::max(r.max_abs_err, err);
    if (r.worst_param.empty() || err / scale > r.max_rel_err) {
      r.max_rel_err = err / scale;
      r.worst_param = model.params()[i].name;
    }
  }
  r.mean_rel_err = std::sqrt(diff_sq / std::max(ref_sq, 1e-300));
  return r;
}

}  // namespace sg
