#include "core/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::vector<std::vector<double>> CopyGrads(Model& model) {
  std::vector<std::vector<double>> out;
  for (Param& p : model.params()) {
    std::vector<double> g;
    if (p.grad.defined() && model.dtype() == DType::kF64)
      g = HostCopy<double>(p.grad);
    else if (p.grad.defined())
      for (float x : HostCopy<float>(p.grad)) g.push_back(x);
    out.push_back(std::move(g));
  }
  return out;
}

// prompt + a random response of `response` tokens, as a sequence whose labels are the response tokens.
Sequence PromptResponse(std::mt19937_64& rng, int64_t vocab, const std::vector<int32_t>& prompt, int64_t response) {
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> all = prompt;
  for (int64_t i = 0; i < response; ++i) all.push_back(token(rng));
  Sequence s;
  s.ids.assign(all.begin(), all.end() - 1);
  const int64_t p = static_cast<int64_t>(prompt.size());
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(all.size()); ++i) s.labels.push_back(i + 1 >= p ? all[i + 1] : -100);
  return s;
}

}  // namespace

absl::StatusOr<Batch> MakeCheckBatch(Model& model, const ObjectiveOptions& objective, int64_t seq_len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t V = model.vocab_size();
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));
  std::normal_distribution<double> noise(0.0, 1.0);
  Batch b;
  std::vector<int32_t> prompt(std::max<int64_t>(1, seq_len / 5));
  for (int32_t& t : prompt) t = token(rng);
  const int64_t response = std::max<int64_t>(1, seq_len - static_cast<int64_t>(prompt.size()));
  if (objective.name == "dpo") {
    for (int64_t p = 0; p < 2; ++p) {
      DpoPair pair;
      pair.chosen = PromptResponse(rng, V, prompt, std::max<int64_t>(1, response - 3 * p));
      pair.rejected = PromptResponse(rng, V, prompt, std::max<int64_t>(1, response / 2));
      const double scale = static_cast<double>(response) * std::log(static_cast<double>(V));
      pair.ref_chosen_logp = -scale * (0.9 + 0.1 * noise(rng));
      pair.ref_rejected_logp = -scale * (0.5 + 0.1 * noise(rng));
      b.pairs.push_back(std::move(pair));
    }
  } else if (objective.name == "grpo") {
    StrategyOptions full;
    Trainer trainer(model, full, {});
    GrpoGroup g;
    for (int64_t i = 0; i < 3; ++i) {
      GrpoCompletion c;
      c.seq = PromptResponse(rng, V, prompt, std::max<int64_t>(1, response - 7 * i));
      c.advantage = i == 0 ? 1.3 : (i == 1 ? -0.7 : 0.4);
      absl::StatusOr<std::vector<double>> lp = trainer.TokenLogprobs(model, c.seq);
      if (!lp.ok()) return lp.status();
      c.old_logprobs = c.ref_logprobs = *lp;
      for (size_t t = 0; t < lp->size(); ++t) {
        if (std::isnan((*lp)[t])) continue;
        c.old_logprobs[t] += 0.3 * noise(rng);  // ratios around exp(+-0.3): some beyond 1 +- clip_eps
        c.ref_logprobs[t] += 0.5 * noise(rng);
      }
      g.completions.push_back(std::move(c));
    }
    b.groups.push_back(std::move(g));
  } else {
    for (int64_t len : {seq_len, std::max<int64_t>(1, seq_len / 3)}) {
      Sequence s;
      for (int64_t i = 0; i < len; ++i) {
        s.ids.push_back(token(rng));
        s.labels.push_back(i % 7 == 6 ? -100 : token(rng));
      }
      b.sequences.push_back(std::move(s));
    }
  }
  return b;
}

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
    r.adjoint_pairs = got->adjoint_pairs;
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
