// Memory plans: a run's exact allocation schedule walked on the meta device (tensors with shapes and byte
// accounting but no storage, ops that do nothing), so that any model at any sequence length is planned in seconds
// on any machine. The walk is the real engine (Trainer::Step on a synthetic batch); only the values are missing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "base/memory.h"
#include "core/lora.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/strategy.h"

namespace sg {

// A model of `spec` (a preset name, a Hugging Face directory or a bare config.json: no weights are read) on
// `device` with LoRA when lora.rank > 0. On the CPU the weights are random (from seed); on meta there are none.
absl::StatusOr<std::unique_ptr<Model>> CreatePlanModel(const std::string& spec, DType dtype, Device device,
                                                       const LoraOptions& lora, uint64_t seed);
// The same architecture, dtype (bf16 storage included) and LoRA as `model`, on meta.
absl::StatusOr<std::unique_ptr<Model>> MetaTwin(Model& model);

struct MemoryPlan {
  int64_t seq_len = 0;
  MemorySnapshot device;   // peaks per category and of the total over the step (weights included)
  int64_t host_bytes = 0;  // host memory of the offloaded KV and KV-gradient pages and expert weights
};

// One training step as every step after a run's first (AdamW moments allocated, gradients by the strategy, the
// AdamW update) on a synthetic batch of sequences of seq_len tokens:
// sft one sequence; dpo one pair (reference log-probs given, no reference model); grpo one group of two
// completions. Peaks are taken from what the model holds when called (its weights and gradients) to the step's
// end. Under `limit` > 0 (bytes of the whole device), a step that would pass it stops: RESOURCE_EXHAUSTED.
// A seq_len whose byte counts overflow 64 bits is INVALID_ARGUMENT naming it. doc_len > 0: the sft sequence is packed
// documents of doc_len tokens (Sequence::doc_starts), attending within each.
absl::StatusOr<MemoryPlan> PlanStep(Model& model, const StrategyOptions& strategy, const ObjectiveOptions& objective,
                                    int64_t seq_len, int64_t limit = 0, int64_t doc_len = 0);

// The longest seq_len in [1, max_seq_len] whose step fits in `memory` bytes (the device's peak total), by
// doubling then bisection to one token; its plan. RESOURCE_EXHAUSTED when even the shortest does not fit.
absl::StatusOr<MemoryPlan> LongestFit(Model& model, const StrategyOptions& strategy, const ObjectiveOptions& objective,
                                      int64_t memory, int64_t max_seq_len);

}  // namespace sg
