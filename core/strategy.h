// Strategies: schedules over the model's per-layer chunk primitives that compute exact (or, for spaco,
// unbiased) parameter gradients of one sequence.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"

namespace sg {

struct StrategyOptions {
  std::string name = "full";  // full | ckpt | seco | spaco | streambp | adjoint
  // tokens per chunk (seco, spaco) or per partition inside a layer (streambp); >= seq_len means one
  int64_t chunk = 512;
  int64_t page_size = 256;    // KV page size in tokens
  int64_t lm_chunk = 256;     // LM-head rows at a time (logits never exceed lm_chunk x vocab)
  int64_t sparse_pages = 0;   // page-level sparse attention budget (StateOptions::sparse_pages); 0 = dense
  bool offload = false;       // seco on transformers: KV and KV-gradient pages live in host memory (StateOptions)
  // Mixtures of experts with a frozen base (LoRA): every MoE layer's expert weights live in host memory and stream
  // through a few device slots (core/expert_offload.h); the Trainer moves them there when it is created.
  bool offload_experts = false;
  int64_t attention_group = 0;  // seco: tokens per attention page group (StateOptions::attention_group); 0 = default
  // spaco: each of a sequence's k chunks is backpropagated with probability spaco_budget / k (so spaco_budget
  // chunks on average), and its gradients are compensated so that the estimate is unbiased (strategies/spaco.cc).
  int64_t spaco_budget = 8;
  double spaco_cap = 2.0;     // cap on the compensation of relayed state gradients; 0 = none (exactly unbiased)
  uint64_t seed = 0;          // sampling seed (spaco); the Trainer derives one per call and sequence
  // adjoint (state-space models, strategies/adjoint.cc): how each layer's scan gradient is formed.
  //   pairs: adjoint sharding, independent vector-Jacobian products over (t, i) with exact per-layer cotangents;
  //   scan:  one reverse scan per chunk seeded from the relayed state gradient (the cheap exact form);
  //   paper: the paper's multi-layer formula, the head's cotangent for every layer (exact only for one layer).
  std::string adjoint_form = "pairs";
  int64_t adjoint_window = kNoAdjointWindow;  // truncation T̄: only pairs with t - i < T̄ (pairs, paper)
  static constexpr int64_t kNoAdjointWindow = std::numeric_limits<int64_t>::max();
  // Set from another thread to stop a step early; checked between layers and chunks.
  const std::atomic<bool>* cancel = nullptr;
};

// Thrown by a strategy when StrategyOptions::cancel is set; the Trainer turns it into absl::CancelledError.
struct Cancelled : std::runtime_error {
  Cancelled() : std::runtime_error("cancelled") {}
};
inline void ThrowIfCancelled(const StrategyOptions& o) {
  if (o.cancel && o.cancel->load(std::memory_order_relaxed)) throw Cancelled();
}

// The sampling seed (spaco's chunks, LoRA dropout masks) of one sequence: the Trainer's `call`-th gradient call
// over a batch, its `index`-th sequence. Distributed runs derive the same seeds, so ranks draw what one process would.
uint64_t SequenceSeed(uint64_t seed, uint64_t call, uint64_t index);

// Runs f and turns what strategies throw into a status: Cancelled -> CANCELLED "<what> cancelled",
// MemoryLimitExceeded -> RESOURCE_EXHAUSTED, any other exception -> INTERNAL "<what> failed: <message>".
absl::Status CatchStrategyErrors(const std::string& what, const std::function<void()>& f);

// One training sequence: ids[i] is the input at position i, labels[i] its target (< 0: ignored).
struct Sequence {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
  // What the LM head computes from the labels' log-probs (core/objective.h); null: token cross-entropy (SFT).
  std::shared_ptr<const TokenObjective> objective = nullptr;
  // Packed documents: the positions where documents start, ascending, the first 0 (empty: one document). A position
  // attends only within its document, RoPE positions and SSM states restart at each start, and no label crosses
  // one (SetDocuments, core/data.h, masks the label of the position before each start).
  std::vector<int64_t> doc_starts = {};
  // The sequence's final token, which is only a label (-1: unknown). Models with a loss over every input token (a
  // mixture of experts' load-balancing loss, Model::HasBatchLoss) run it too, as transformers does.
  int32_t last_token = -1;
};

struct GradResult {
  LossSum loss_sum;                  // sum of token losses (not scaled; read it after the step's device work)
  int64_t tokens = 0;                // valid labels seen
  int64_t chunks = 1;                // chunks the sequence was split into
  int64_t chunks_backpropagated = 1;  // of which were backpropagated (spaco: a random subset)
  int64_t adjoint_pairs = 0;  // adjoint: vector-Jacobian products (t, i) per channel, summed over layers
  int64_t offloaded_bytes = 0;  // seco with KV offload: host memory that held the KV and KV-gradient pages
};

// Accumulates grad_scale * d(sum of token losses)/d(params) into the model's gradients.
using StrategyFn = std::function<GradResult(Model&, const Sequence&, double grad_scale, const StrategyOptions&)>;

// Looks up a strategy by name; the error lists the known ones.
absl::StatusOr<StrategyFn> FindStrategy(const std::string& name);
std::vector<std::string> StrategyNames();
absl::Status ValidateStrategyOptions(const StrategyOptions& o);

// The chunks [0, c), [c, 2c), ... covering [0, seq_len); the last may be shorter.
std::vector<Chunk> SplitIntoChunks(int64_t seq_len, int64_t chunk);

// Strategies (one file each under core/strategies/).
GradResult FullBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);
GradResult CheckpointedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);
GradResult ChunkedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);
GradResult StreamBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);
GradResult SparseChunkedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);
GradResult AdjointBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o);

// Strategies that need a model family (adjoint: an SSM) say so by name.
absl::Status ValidateStrategyForModel(const StrategyOptions& o, const Model& m);

// The loss of a sequence without gradients (evaluation; the forward-only baseline of benchmarks): chunks of
// o.chunk tokens forward in order, keeping only the state, as the first stage of seco.
GradResult EvaluateLoss(Model& m, const Sequence& s, const StrategyOptions& o);

// spaco's budget t must be in [1, k] for a sequence of k chunks; the error names the flag and the sequence.
absl::Status ValidateSpacoBudget(const StrategyOptions& o, int64_t seq_len, const std::string& what);

}  // namespace sg
