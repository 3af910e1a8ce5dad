// Strategies: schedules over the model's per-layer chunk primitives that compute exact (or, for spaco,
// unbiased) parameter gradients of one sequence.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"

namespace sg {

struct StrategyOptions {
  std::string name = "full";  // full | ckpt | seco | spaco
  int64_t chunk = 512;        // tokens per chunk (seco, spaco); a chunk >= seq_len means one chunk
  int64_t page_size = 256;    // KV page size in tokens
  int64_t lm_chunk = 256;     // LM-head rows at a time (logits never exceed lm_chunk x vocab)
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

// One training sequence: ids[i] is the input at position i, labels[i] its target (< 0: ignored).
struct Sequence {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
};

struct GradResult {
  double loss_sum = 0;  // sum of token losses (not scaled)
  int64_t tokens = 0;   // valid labels seen
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

}  // namespace sg
