// Evaluation on held-out sequences: mean token loss and perplexity, next-token accuracy (arg max of the logits
// equals the label) and, for the synthetic retrieval task, accuracy as a function of the distance between a
// query and its key's pair token. One chunked forward pass per sequence (EvaluateLoss's schedule: StrategyOptions'
// chunk tokens at a time, lm_chunk rows of logits), through the model's HeadLoss, so it works for every model
// family and never holds T x vocab logits.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data.h"
#include "core/model.h"
#include "core/strategy.h"

namespace sg {

// Distances are bucketed by powers of two: bucket k holds [2^k, 2^(k+1)), so bucket 0 is distance 1.
int DistanceBucket(int64_t distance);  // distance >= 1
int64_t DistanceBucketLow(int bucket);   // 2^k
int64_t DistanceBucketHigh(int bucket);  // 2^(k+1), exclusive

struct DistanceBucketStats {
  int64_t lo = 0, hi = 0;  // distances in [lo, hi)
  int64_t count = 0;       // labelled positions whose distance falls here
  int64_t correct = 0;     // of which the arg max equals the label
  double loss_sum = 0;     // sum of -log p(label)
  double accuracy() const { return count ? static_cast<double>(correct) / static_cast<double>(count) : 0.0; }
  double loss() const { return count ? loss_sum / static_cast<double>(count) : 0.0; }
};

struct EvalResult {
  int64_t sequences = 0;
  int64_t tokens = 0;    // labelled positions
  double loss_sum = 0;   // sum of -log p(label) over them
  int64_t correct = 0;   // labelled positions whose arg max equals the label
  // Retrieval task only (distances given): buckets 0 .. the largest seen, empty ones included (count 0).
  std::vector<DistanceBucketStats> by_distance;

  double loss() const { return tokens ? loss_sum / static_cast<double>(tokens) : 0.0; }  // mean token loss
  double perplexity() const;                                                                 // exp(loss())
  double accuracy() const { return tokens ? static_cast<double>(correct) / static_cast<double>(tokens) : 0.0; }
};

// Per position of one sequence: log p(label) and the arg max of the logits (NaN and -1 where unlabelled).
struct TokenPredictions {
  std::vector<double> logp;
  std::vector<int32_t> argmax;
};

// One chunked forward pass over s (o.chunk, o.page_size, o.lm_chunk; s.objective is ignored).
absl::StatusOr<TokenPredictions> PredictTokens(Model& m, const Sequence& s, const StrategyOptions& o);

// Adds one sequence's predictions to *r. distances (may be null): per labelled position in order, the key-query
// distance (RetrievalTask::Make's); its size must equal the number of labels.
absl::Status AccumulateEval(const Sequence& s, const TokenPredictions& p, const std::vector<int64_t>* distances,
                            EvalResult* r);

// A held-out evaluation set; distances is empty or holds one entry per sequence (retrieval task).
struct EvalSet {
  std::vector<Sequence> sequences;
  std::vector<std::vector<int64_t>> distances;
};

// Training draws RetrievalTask::Make(seed, 0), (seed, 1), ...; the held-out set uses indices from here on.
constexpr int64_t kHeldOutRetrievalIndex = int64_t{1} << 40;
// count sequences of the task at indices kHeldOutRetrievalIndex + i, with their distances.
EvalSet HeldOutRetrieval(const RetrievalTask& task, uint64_t seed, int64_t count);

// Evaluates every sequence of the set (checked against the vocabulary first).
absl::StatusOr<EvalResult> Evaluate(Model& m, const EvalSet& set, const StrategyOptions& o);

}  // namespace sg
