// Data-parallel training over a Communicator: each rank computes the gradients of its shard of the batch with the
// existing Trainer and strategy (no per-chunk or per-partition communication), the gradients are then all-reduced
// once per parameter, and every rank applies the same optimizer step (clipping and AdamW see identical gradients,
// so the ranks' weights stay identical).
//
// Normalisation: the objective's count of units (valid tokens for sft, pairs for dpo, groups for grpo) is summed
// over ranks first, and each rank scales its shard's gradient by 1 / that total, so the sum over ranks is exactly
// the gradient of the whole batch's mean loss, as one process on the whole batch computes it (the shard's
// first_index keeps spaco's sampling and LoRA dropout those of the single process too).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/trainer.h"

namespace sg::dist {

// Rank `rank`'s contiguous part of `whole`: records [n r / size, n (r+1) / size) of each of its lists (sequences,
// pairs, groups). *first_index (if not null) gets the position of the shard's first strategy sequence in the whole
// batch (sft: sequences before it; dpo: 2 per pair; grpo: one per completion), for ComputeShardGradients.
Batch ShardOf(const Batch& whole, int rank, int size, uint64_t* first_index);

class DataParallel {
 public:
  // Both must outlive this object. Call CheckConfig once before training.
  DataParallel(Trainer& trainer, Communicator& comm) : trainer_(trainer), comm_(comm) {}

  // The model configuration and the strategy, optimizer and objective options (sg::TrainerRunConfig) must be the
  // same on every rank: a mismatch fails on every rank (CheckSameConfig).
  absl::Status CheckConfig();

  // The gradients of the whole batch's mean loss on every rank, from this rank's shard (which may be empty when
  // the batch has fewer records than ranks). Metrics are those of the whole batch (loss, tokens, chunks summed
  // over ranks). A failure on any rank (an invalid shard, a NaN loss) fails on every rank, naming the rank.
  absl::StatusOr<StepMetrics> ComputeGradients(const Batch& shard, uint64_t first_index);
  // ComputeGradients, then the optimizer step (Trainer::OptimizerStep) on every rank.
  absl::StatusOr<StepMetrics> Step(const Batch& shard, uint64_t first_index);

  // Bytes this rank sent in its last ComputeGradients (payloads of the all-reduces).
  int64_t bytes_last_step() const { return bytes_last_step_; }

  // ZeRO-1 (optimizer-state sharding), set before the first Step: every parameter with a gradient gets one owner
  // rank (contiguous in model.params() order, balanced by element count: parameter i goes to rank
  // floor(W (elements before i + half of its own) / all elements)), and Step then keeps AdamW moments only for the
  // parameters this rank owns (optimizer memory ~1/W at parameter granularity), steps them after the same global
  // norm clipping every rank computes from the all-reduced gradients, and broadcasts each updated parameter from its
  // owner, so the weights equal those of the unsharded step. The trainer's moments of other parameters stay
  // undefined: a checkpoint written from one rank holds only that rank's moments (cli:train does not use it).
  void set_shard_optimizer(bool on) { shard_optimizer_ = on; }
  bool shard_optimizer() const { return shard_optimizer_; }
  // The owner rank of model.params()[i] under ZeRO-1 (-1 for parameters without a gradient).
  std::vector<int> OptimizerOwners();

 private:
  absl::Status ShardedOptimizerStep(StepMetrics* metrics);
  bool shard_optimizer_ = false;
  Trainer& trainer_;
  Communicator& comm_;
  int64_t bytes_last_step_ = 0;
};

}  // namespace sg::dist
