// Training loop pieces: gradients of a batch (or of micro-batches accumulated) through a strategy, then an AdamW
// step at the scheduled learning rate (core/optimizer.h, core/lr_schedule.h).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/optimizer.h"
#include "core/strategy.h"

namespace sg {

struct StepMetrics {
  double loss = 0;        // mean token loss of the batch
  int64_t tokens = 0;     // valid labels in the batch
  double grad_norm = 0;   // before clipping
  int64_t chunks = 0;                 // chunks over the batch's sequences
  int64_t chunks_backpropagated = 0;  // of which were backpropagated (fewer only for spaco)
  int64_t adjoint_pairs = 0;          // adjoint: (t, i) vector-Jacobian products per channel, over layers
  int64_t offloaded_bytes = 0;        // host memory of the largest sequence's offloaded KV pages + expert weights
  double lr = 0;                      // learning rate of the optimizer step (set by OptimizerStep)
  int64_t micro_batches = 1;          // batches whose gradients this step accumulated
};

// Sets the calling thread's OpenMP and OpenBLAS thread count (the OpenMP build of OpenBLAS follows the OpenMP one)
// for the guard's lifetime and restores the previous count after it; threads <= 0 leaves them alone.
class ScopedThreads {
 public:
  explicit ScopedThreads(int threads);
  ~ScopedThreads();
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int previous_ = 0;  // 0: nothing to restore
};

// Sets the calling thread's OpenMP and OpenBLAS thread count for good (the tools' --threads); threads <= 0: no change.
void SetThreads(int threads);

// What a checkpoint needs of a trainer besides the model and the optimizer moments.
struct TrainerState {
  int64_t step = 0;             // optimizer steps taken
  uint64_t sampling_calls = 0;  // gradient passes so far: spaco's sampling stream (with the strategy seed)
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
  // Gradient accumulation, streaming: adds the micro-batch's gradient of the objective's sum (token losses for
  // sft, pair losses for dpo, group losses for grpo), zeroing gradients first when no accumulation is pending;
  // OptimizerStep then divides by the total count (valid tokens, pairs, groups) so that the step equals one on a
  // batch holding every micro-batch's sequences. The returned loss is the micro-batch's mean.
  absl::StatusOr<StepMetrics> AccumulateGradients(const Batch& micro_batch);
  // Fails with a NaN/Inf gradient naming the parameter; otherwise divides an accumulated gradient by its count,
  // clips by global norm and applies AdamW at ScheduledLr(optimizer, step + 1) to every parameter with a gradient.
  // After accumulation, metrics (if not null) gets the step's loss, tokens and chunk counts over the micro-batches.
  absl::Status OptimizerStep(StepMetrics* metrics);
  // Data parallelism (distributed/data_parallel.h): `shard` is one rank's part of a batch whose count of
  // normalising units (valid tokens for sft, pairs for dpo, groups for grpo) over all ranks is `norm`. Zeroes
  // gradients, then accumulates d(the objective's sum over the shard)/d(params) / norm, so that the sum over ranks
  // is the gradient of the whole batch's mean. first_index is the position of the shard's first sequence as the
  // strategy sees the whole batch (sft: sequences; dpo: 2 per pair; grpo: one per completion), so that spaco's
  // sampling and LoRA dropout draw what one process on the whole batch would. StepMetrics::loss is the shard's
  // share (its loss sum / norm). Call OptimizerStep after the gradients have been summed over ranks.
  absl::StatusOr<StepMetrics> ComputeShardGradients(const Batch& shard, double norm, uint64_t first_index);
  // The batch's count of normalising units (valid tokens, pairs, groups), after validating it.
  absl::StatusOr<int64_t> CountUnits(const Batch& batch) const;
  // Gradients then the optimizer step.
  absl::StatusOr<StepMetrics> Step(const std::vector<Sequence>& batch);
  absl::StatusOr<StepMetrics> Step(const Batch& batch);
  // One optimizer step over micro-batches whose gradients accumulate one micro-batch at a time (all of them are
  // validated first). Loss and gradient equal those of one batch of all their sequences (same normalisation,
  // same spaco sampling), whatever the split.
  absl::StatusOr<StepMetrics> Step(const std::vector<Batch>& micro_batches);
  // Per position, log p(label) under `model` (NaN where the label is ignored), by a chunked forward pass.
  absl::StatusOr<std::vector<double>> TokenLogprobs(Model& model, const Sequence& s);
  // TokenLogprobs under the reference (the reference model, or the model without adapters); has_reference().
  absl::StatusOr<std::vector<double>> ReferenceLogprobs(const Sequence& s);

  Model& model() { return model_; }
  // Sets, changes or clears (nullptr) the frozen reference model of dpo/grpo; it must outlive its use.
  void set_reference(Model* reference) {
    reference_ = reference;
    reference_is_base_ = false;
  }
  // Makes the reference of dpo/grpo this trainer's model with its LoRA adapters switched off (LoraDisabled), as
  // StreamBP does: the frozen base weights are the reference, so no second model or weight copy is needed. A step
  // that needs reference log-probs then requires LoRA on the model.
  void set_reference_base_model() {
    reference_ = nullptr;
    reference_is_base_ = true;
  }
  bool has_reference() const { return reference_ || reference_is_base_; }
  int64_t step() const { return adam_.step(); }
  const StrategyOptions& strategy() const { return strategy_options_; }
  const OptimizerOptions& optimizer_options() const { return opt_; }
  const ObjectiveOptions& objective() const { return objective_; }
  // The AdamW moments and step (checkpoints read and restore them).
  AdamW& optimizer() { return adam_; }
  TrainerState state() const { return {adam_.step(), calls_}; }
  // Restores the step counter and the sampling stream (checkpoint resume); drops a pending accumulation.
  void set_state(const TrainerState& s);
  // Another thread may set *flag to stop the running step (it returns absl::CancelledError).
  void set_cancel_flag(const std::atomic<bool>* flag) { strategy_options_.cancel = flag; }
  // The thread count the trainer's calls run with (0: the calling thread's OpenMP default). The trainer does not
  // apply it itself (callers wrap their calls in ScopedThreads); checkpoints record threads() as "runtime.threads".
  void set_num_threads(int threads) { num_threads_ = threads; }
  int num_threads() const { return num_threads_; }
  // num_threads(), or the calling thread's OpenMP thread count when it is 0.
  int threads() const;

 private:
  Model& model_;
  // Checks options and batch; returns the number of valid labels.
  absl::StatusOr<int64_t> ValidateBatch(const std::vector<Sequence>& batch, bool for_gradients = true) const;
  // Where a gradient pass stands: its sampling call, the index of its next sequence (spaco seeds), whether
  // gradients are still to be zeroed, and the running loss sums (so that micro-batches add up their losses in the
  // order one batch of all their sequences would).
  struct Pass {
    uint64_t call = 0;
    uint64_t next_index = 0;
    bool zero = true;
    double loss_sum = 0;  // token losses (sft, grpo)
    double dpo_loss = 0;  // sum over pairs of the pair loss / norm
  };
  // The objective's gradient of `batch` scaled by 1/norm (norm 0: the batch's own count of valid tokens, pairs or
  // groups, i.e. its mean), added to the gradients (zeroed first when pass->zero); loss is the pass's running sum
  // (this batch's and the earlier ones') over 'norm'.
  // *count (if not null) gets the batch's own count.
  absl::StatusOr<StepMetrics> Gradients(const Batch& batch, double norm, Pass* pass, int64_t* count);
  absl::StatusOr<StepMetrics> SftGradients(const std::vector<Sequence>& seqs, double norm, Pass* pass,
                                           int64_t* count);
  // Runs the strategy over sequences (each with its objective).
  absl::StatusOr<StepMetrics> Backprop(const std::vector<Sequence>& seqs, double grad_scale, Pass* pass);
  // Model::HasBatchLoss: the batch with each sequence's last token as an input (no label), and the statistics pass
  // over it (the batch term of the loss).
  absl::StatusOr<std::vector<Sequence>> WithLastTokens(const std::vector<Sequence>& batch) const;
  // FAILED_PRECONDITION when no parameter has a gradient: a model created with frozen_base and no LoRA adapters.
  absl::Status CheckTrainable() const;
  // Refuses `what` (several micro-batches, data-parallel shards) for a model with a batch loss.
  absl::Status OneBatchForBatchLoss(const char* what) const;
  absl::StatusOr<double> BatchStatistics(const std::vector<Sequence>& whole);
  absl::StatusOr<StepMetrics> CheckedLoss(absl::StatusOr<StepMetrics> m);  // refuses a non-finite loss
  absl::StatusOr<StepMetrics> DpoGradients(const std::vector<DpoPair>& pairs, double norm, Pass* pass);
  // A gradient pass's result once complete: a tensor-parallel model's partial gradients summed over its group.
  absl::StatusOr<StepMetrics> WholeGradients(absl::StatusOr<StepMetrics> m);
  absl::StatusOr<StepMetrics> GrpoGradients(const std::vector<GrpoGroup>& groups, double norm, Pass* pass);
  StrategyOptions strategy_options_;
  OptimizerOptions opt_;
  ObjectiveOptions objective_;
  Model* reference_;
  bool reference_is_base_ = false;  // set_reference_base_model
  StrategyFn strategy_;
  AdamW adam_;
  uint64_t calls_ = 0;  // gradient passes: every pass samples afresh (spaco)
  int num_threads_ = 0;
  // Streaming accumulation not yet applied by OptimizerStep.
  int64_t pending_micro_batches_ = 0;
  int64_t pending_units_ = 0;
  StepMetrics pending_;  // sums over the pending micro-batches (loss: sum, not mean)
  bool partial_grads_ = false;  // AccumulateGradients left tensor-parallel partial gradients for OptimizerStep
};

// The chunk a memory budget allows (the tools' --memory_budget): the largest chunk (seco, spaco, adjoint) or
// partition (streambp) whose gradient pass on `probe` (the longest sequence a run will see) fits the budget,
// planned on a meta twin of the model (core/plan.h: the exact allocations, no compute) under a memory limit of the
// budget minus `reserved` (e.g. optimizer moments not allocated yet). Candidates: the whole sequence, then powers
// of two below it down to 16 (spaco: only those giving at least spaco_budget chunks). Strategies without a chunk (full,
// ckpt) are probed as they are. ResourceExhausted when nothing fits, with the bytes the smallest candidate needs
// (measured under a limit of 16 x the budget) against the budget.
struct BudgetFit {
  bool chunked = false;    // the strategy has a chunk to pick
  int64_t chunk = 0;       // the chosen chunk (chunked strategies)
  int64_t peak_bytes = 0;  // the gradient pass's peak at that chunk plus `reserved`
  std::vector<std::pair<int64_t, int64_t>> probes;  // chunk -> peak bytes + reserved, or -1: over the budget
};
absl::StatusOr<BudgetFit> FitMemoryBudget(Model& model, const StrategyOptions& strategy, const Sequence& probe,
                                          int64_t budget, int64_t reserved);

}  // namespace sg
