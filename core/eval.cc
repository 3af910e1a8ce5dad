#include "core/eval.h"

#include <cmath>
#include <exception>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/objective.h"

namespace sg {

int DistanceBucket(int64_t distance) {
  int k = 0;
  while (k < 62 && (distance >> (k + 1)) > 0) ++k;
  return k;
}
int64_t DistanceBucketLow(int bucket) { return int64_t{1} << bucket; }
int64_t DistanceBucketHigh(int bucket) { return int64_t{1} << (bucket + 1); }

double EvalResult::perplexity() const { return std::exp(loss()); }

namespace {

// Records log p(label) and the arg max at every labelled position; the head computes both from one chunk of logits.
class Predicting final : public TokenObjective {
 public:
  explicit Predicting(TokenPredictions* out) : out_(out) {}
  double Term(int64_t t, double logp, double* dloss) const override {
    out_->logp[t] = logp;
    *dloss = -1;
    return -logp;
  }
  bool wants_argmax() const override { return true; }
  void Argmax(int64_t t, int32_t token) const override { out_->argmax[t] = token; }

 private:
  TokenPredictions* out_;
};

}  // namespace

absl::StatusOr<TokenPredictions> PredictTokens(Model& m, const Sequence& s, const StrategyOptions& o) {
  if (absl::Status v = ValidateSequence(s, m.vocab_size(), "evaluation sequence"); !v.ok()) return v;
  if (o.chunk <= 0 || o.page_size <= 0 || o.lm_chunk <= 0)
    return absl::InvalidArgumentError(absl::StrCat("evaluation: chunk (", o.chunk, "), page_size (", o.page_size,
                                                   ") and lm_chunk (", o.lm_chunk, ") must be positive"));
  TokenPredictions p;
  p.logp.assign(s.ids.size(), std::nan(""));
  p.argmax.assign(s.ids.size(), -1);
  Sequence recorded{s.ids, s.labels, std::make_shared<Predicting>(&p), s.doc_starts};
  if (absl::Status st = CatchStrategyErrors("evaluation", [&] { EvaluateLoss(m, recorded, o); }); !st.ok()) return st;
  return p;
}

absl::Status AccumulateEval(const Sequence& s, const TokenPredictions& p, const std::vector<int64_t>* distances,
                            EvalResult* r) {
  const size_t n = s.labels.size();
  if (p.logp.size() != n || p.argmax.size() != n)
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: predictions for ", p.logp.size(), " positions of a ", n, "-token sequence"));
  int64_t labelled = 0;
  for (int32_t l : s.labels) labelled += l >= 0;
  if (distances && static_cast<int64_t>(distances->size()) != labelled)
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: ", distances->size(), " distances for ", labelled, " labelled positions"));
  ++r->sequences;
  int64_t k = 0;  // labelled positions so far
  for (size_t t = 0; t < n; ++t) {
    if (s.labels[t] < 0) continue;
    const double loss = -p.logp[t];
    const bool correct = p.argmax[t] == s.labels[t];
    ++r->tokens;
    r->loss_sum += loss;
    r->correct += correct;
    if (distances) {
      const int64_t d = (*distances)[k];
      if (d < 1) return absl::InvalidArgumentError(absl::StrCat("evaluation: distance ", d, " at position ", t));
      const int b = DistanceBucket(d);
      while (static_cast<int>(r->by_distance.size()) <= b) {
        const int i = static_cast<int>(r->by_distance.size());
        r->by_distance.push_back({DistanceBucketLow(i), DistanceBucketHigh(i)});
      }
      DistanceBucketStats& bs = r->by_distance[b];
      ++bs.count;
      bs.correct += correct;
      bs.loss_sum += loss;
    }
    ++k;
  }
  return absl::OkStatus();
}

EvalSet HeldOutRetrieval(const RetrievalTask& task, uint64_t seed, int64_t count) {
  EvalSet set;
  set.sequences.resize(count);
  set.distances.resize(count);
  for (int64_t i = 0; i < count; ++i) set.sequences[i] = task.Make(seed, kHeldOutRetrievalIndex + i, &set.distances[i]);
  return set;
}

absl::StatusOr<EvalResult> Evaluate(Model& m, const EvalSet& set, const StrategyOptions& o) {
  if (set.sequences.empty()) return absl::InvalidArgumentError("evaluation: no sequences");
  if (!set.distances.empty() && set.distances.size() != set.sequences.size())
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: distances for ", set.distances.size(), " of ", set.sequences.size(), " sequences"));
  EvalResult r;
  for (size_t i = 0; i < set.sequences.size(); ++i) {
    absl::StatusOr<TokenPredictions> p = PredictTokens(m, set.sequences[i], o);
    if (!p.ok()) return absl::Status(p.status().code(), absl::StrCat("sequence ", i, ": ", p.status().message()));
    if (absl::Status s = AccumulateEval(set.sequences[i], *p, set.distances.empty() ? nullptr : &set.distances[i], &r);
        !s.ok())
      return s;
  }
  if (r.tokens == 0) return absl::InvalidArgumentError("evaluation: the sequences have no labelled positions");
  return r;
}

}  // namespace sg
