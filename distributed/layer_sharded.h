// Layer-sharded adjoint sharding for SSMs (paper §4.4, made exact; ../shared/notes/adjoint-sharding.md): the ranks
// of a Communicator each own a contiguous block of layers, and seco's schedule runs as a pipeline over them.
//
// Blocks: with L layers and W ranks, rank r owns layers [floor(L r / W), floor(L (r+1) / W)): every rank owns at
// least one layer, and when W does not divide L the later ranks own the extra layers (3 layers on 2 ranks: rank 0
// owns layer 0, rank 1 layers 1 and 2). W > L is an error naming both numbers.
//
// Schedule, per sequence (every rank holds the whole batch; only the sequence state of its own layers is ever
// written): stage 1 runs chunks 0 .. n-2 forward: rank 0 embeds and runs its layers, sends the boundary
// activations to rank 1, ..., the last rank runs its layers (its last layer only appends state). Stage 2 visits
// chunks in reverse: the same forward with saved activations, then the last rank evaluates the head (loss and
// cotangent) and backpropagates its layers, sends dx (the exact cotangent dL/dy of the layer below) to the rank
// before, ..., down to rank 0, which does the embedding backward. Each layer's state gradient (or, for the pairs
// and window forms, the relayed cotangents of later tokens) stays on its owner. Every adjoint form but "paper"
// works (pairs, truncated window, scan): they live in the model's state options.
//
// Parameters: rank 0 owns the embedding, the last rank the final norm and the LM head, each rank its layers'.
// A rank accumulates gradients only into what it owns (the rest stay zero); tied embeddings (Mamba's default) get
// the head's part of their gradient sent from the last rank to rank 0. There is no gradient all-reduce.
// Optimizer: the global gradient norm is one scalar all-reduce; each rank clips and applies AdamW to the
// parameters it owns (its moments exist only for them: optimizer memory ~1/W), then every parameter is broadcast
// from its owner, so all ranks hold the same full model after each step (as one process would have it).
//
// Failure: the batch is validated on every rank before any communication (every rank sees the same error); a
// communication failure (a rank stuck or gone) surfaces as the Communicator's timeout error.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "core/strategy.h"
#include "core/trainer.h"

namespace sg::dist {

struct LayerBlock {
  int begin = 0;  // first layer owned
  int end = 0;    // one past the last
};

// Rank `rank`'s block of `layers` layers over `size` ranks (the rule above); INVALID_ARGUMENT when size > layers.
absl::StatusOr<LayerBlock> LayerBlockOf(int layers, int rank, int size);

class LayerShardedAdjoint {
 public:
  // model and comm must outlive this object. strategy.name must be "adjoint" (any form but "paper").
  LayerShardedAdjoint(Model& model, StrategyOptions strategy, OptimizerOptions optimizer, Communicator& comm);

  // The model family (ssm), the strategy and the world size against the layer count; the same on every rank.
  absl::Status Validate() const;
  // Zeroes gradients, then accumulates d(mean token loss over the batch)/d(owned params) (sft). Metrics (loss,
  // tokens, chunks, adjoint pairs over all ranks) are the same on every rank.
  absl::StatusOr<StepMetrics> ComputeGradients(const std::vector<Sequence>& batch);
  // ComputeGradients, then the sharded optimizer step and the broadcast of the updated parameters.
  absl::StatusOr<StepMetrics> Step(const std::vector<Sequence>& batch);

  // The rank owning model.params()[i].
  int OwnerOf(size_t param_index) const { return owner_[param_index]; }
  const LayerBlock& block() const { return block_; }
  AdamW& optimizer() { return adam_; }
  int64_t bytes_last_step() const { return bytes_last_step_; }

 private:
  absl::Status Sequence1(const Sequence& s, double grad_scale, uint64_t seed, StepMetrics& m);
  absl::Status OptimizerStep(StepMetrics* metrics);

  Model& model_;
  StrategyOptions strategy_;
  OptimizerOptions opt_;
  Communicator& comm_;
  absl::Status valid_;
  LayerBlock block_;
  std::vector<int> owner_;
  int embed_index_ = -1;  // the embedding parameter
  bool tied_ = false;     // the LM head reads the embedding
  AdamW adam_;
  uint64_t calls_ = 0;
  int64_t bytes_last_step_ = 0;
};

}  // namespace sg::dist
