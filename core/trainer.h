// Training loop pieces: gradients of a batch through a strategy, then an AdamW step.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/strategy.h"

namespace sg {

struct OptimizerOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double clip_grad_norm = 1.0;  // 0 = no clipping
};

struct StepMetrics {
  double loss = 0;        // mean token loss of the batch
  int64_t tokens = 0;     // valid labels in the batch
  double grad_norm = 0;   // before clipping
  int64_t chunks = 0;                 // chunks over the batch's sequences
  int64_t chunks_backpropagated = 0;  // of which were backpropagated (fewer only for spaco)
  int64_t adjoint_pairs = 0;          // adjoint: (t, i) vector-Jacobian products per channel, over layers
};

class Trainer {
 public:
  // reference: the frozen reference model of dpo/grpo when the data carries no reference log-probs.
  Trainer(Model& model, StrategyOptions strategy, OptimizerOptions optimizer, ObjectiveOptions objective = {},
          Model* reference = nullptr);

  // Zeroes gradients, then accumulates d(mean token loss over the batch)/d(params) with the strategy (sft).
  absl::StatusOr<StepMetrics> ComputeGradients(const std::vector<Sequence>& batch);
  // The same for the trainer's objective: sft reads batch.sequences, dpo batch.pairs, grpo batch.groups.
  // StepMetrics::loss is the objective's value (dpo: mean over pairs of -log sigmoid(z)).
  absl::StatusOr<StepMetrics> ComputeGradients(const Batch& batch);
  // The batch's mean token loss without gradients (chunked forward, see EvaluateLoss in strategy.h).
  absl::StatusOr<StepMetrics> EvaluateLoss(const std::vector<Sequence>& batch);
  // Clips by global norm and applies AdamW to every parameter with a gradient.
  absl::Status OptimizerStep(StepMetrics* metrics);
  // Both of the above.
  absl::StatusOr<StepMetrics> Step(const std::vector<Sequence>& batch);
  absl::StatusOr<StepMetrics> Step(const Batch& batch);
  // Per position, log p(label) under `model` (NaN where the label is ignored), by a chunked forward pass.
  absl::StatusOr<std::vector<double>> TokenLogprobs(Model& model, const Sequence& s);

  Model& model() { return model_; }
  // Sets, changes or clears (nullptr) the frozen reference model of dpo/grpo; it must outlive its use.
  void set_reference(Model* reference) { reference_ = reference; }
  int64_t step() const { return step_; }
  const StrategyOptions& strategy() const { return strategy_options_; }
  // Another thread may set *flag to stop the running step (it returns absl::CancelledError).
  void set_cancel_flag(const std::atomic<bool>* flag) { strategy_options_.cancel = flag; }

 private:
  Model& model_;
  // Checks options and batch; returns the number of valid labels.
  absl::StatusOr<int64_t> ValidateBatch(const std::vector<Sequence>& batch, bool for_gradients = true) const;
  // Runs the strategy over sequences (each with its objective) after zeroing gradients.
  absl::StatusOr<StepMetrics> Backprop(const std::vector<Sequence>& seqs, double grad_scale);
  absl::StatusOr<StepMetrics> DpoGradients(const std::vector<DpoPair>& pairs);
  absl::StatusOr<StepMetrics> GrpoGradients(const std::vector<GrpoGroup>& groups);
  StrategyOptions strategy_options_;
  OptimizerOptions opt_;
  ObjectiveOptions objective_;
  Model* reference_;
  StrategyFn strategy_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
  uint64_t calls_ = 0;  // ComputeGradients calls: every call samples afresh (spaco)
};

}  // namespace sg
