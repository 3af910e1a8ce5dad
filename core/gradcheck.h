// Compares a strategy's gradients with full backprop's on the same model and batch.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/strategy.h"

namespace sg {

struct GradCheckResult {
  double loss = 0;            // the strategy's loss
  double reference_loss = 0;  // full backprop's loss
  double max_rel_err = 0;     // max over parameters of max|g - g_ref| / max|g_ref|
  double max_abs_err = 0;
  std::string worst_param;
  int64_t params_checked = 0;
  int64_t samples = 1;        // gradients averaged (stochastic strategies)
  double mean_rel_err = 0;    // |mean gradient - exact|_2 / |exact|_2 over all parameters together
  int64_t adjoint_pairs = 0;  // adjoint: (t, i) vector-Jacobian products per channel, summed over layers and batch
};

// The strategy's gradient, averaged over `samples` independent calls (each spaco call samples afresh), against
// full backprop's. For an unbiased strategy mean_rel_err falls like 1/sqrt(samples).
absl::StatusOr<GradCheckResult> CheckAgainstFull(Model& model, const Batch& batch, const StrategyOptions& strategy,
                                                 const ObjectiveOptions& objective, int64_t samples = 1);
// A random batch for checking an objective: sft, two sequences (seq_len and seq_len / 3 tokens, some labels
// ignored); dpo, two pairs with prompts and responses of different lengths and given reference log-probs; grpo,
// one group of three completions with advantages of both signs, old log-probs = the current ones perturbed so
// that some ratios are clipped, and reference log-probs.
absl::StatusOr<Batch> MakeCheckBatch(Model& model, const ObjectiveOptions& objective, int64_t seq_len, uint64_t seed);

// sft on plain sequences.
absl::StatusOr<GradCheckResult> CheckAgainstFull(Model& model, const std::vector<Sequence>& batch,
                                                 const StrategyOptions& strategy, int64_t samples = 1);

}  // namespace sg
