// Detailed evaluation: loss, perplexity, accuracy and accuracy by distance (sg::Evaluate) into sg_eval_result.
#include "core/eval.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {
namespace {

// The batch and its distances, aligned with the C API's labels: the engine's position i predicts label i + 1.
sg_status* BuildEvalSet(const char* fn, int64_t vocab, const sg_batch& b, const int64_t* distances, EvalSet* set) {
  if (sg_status* s = BuildBatch(fn, vocab, b, &set->sequences)) return s;
  if (distances) {
    int64_t off = 0;
    for (Sequence& q : set->sequences) {
      std::vector<int64_t>* d = q.ids.empty() ? nullptr : &set->distances.emplace_back();
      for (size_t i = 0; i < q.labels.size(); ++i, ++off) {
        if (q.labels[i] < 0) continue;
        if (distances[off + 1] < 1)
          return Invalid(absl::StrCat(fn, ": distances[", off + 1, "] is ", distances[off + 1], " where the label is ",
                                      q.labels[i], "; need a distance >= 1"));
        d->push_back(distances[off + 1]);
      }
      ++off;  // the sequence's last token: a label only
    }
  }
  set->sequences = WithPositions(std::move(set->sequences));
  return nullptr;
}

void FillEvalResult(const EvalResult& r, int64_t peak_bytes, double seconds, sg_eval_result* out) {
  out->sequences = r.sequences;
  out->tokens = r.tokens;
  out->loss = r.loss();
  out->perplexity = r.perplexity();
  out->correct = r.correct;
  out->accuracy = r.accuracy();
  out->peak_bytes = peak_bytes;
  out->seconds = seconds;
  const int64_t buckets = std::min<int64_t>(static_cast<int64_t>(r.by_distance.size()), SG_MAX_DISTANCE_BUCKETS);
  out->num_buckets = buckets;
  for (int64_t k = 0; k < SG_MAX_DISTANCE_BUCKETS; ++k) {
    const bool in = k < buckets;
    out->bucket_count[k] = in ? r.by_distance[k].count : 0;
    out->bucket_correct[k] = in ? r.by_distance[k].correct : 0;
    out->bucket_loss[k] = in ? r.by_distance[k].loss() : 0;
  }
}

// sg_trainer_evaluate_detailed(_batch)'s body.
sg_status* EvaluateDetailed(const char* fn, sg_trainer* trainer, const sg_batch* b, const int64_t* distances,
                            sg_eval_result* out) {
  return Guard(fn, [&] {
    return Agreed(fn, trainer, [&]() -> sg_status* {
      if (!trainer) return NullArg(fn, "trainer");
      if (!out) return NullArg(fn, "out");
      if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_eval_result))) return s;
      if (sg_status* s = CheckBatch(fn, b)) return s;
      sg::EvalSet set;
      if (sg_status* s = BuildEvalSet(fn, trainer->core->model->vocab_size(), *b, distances, &set)) return s;
      BusyGuard guard(*trainer->core);
      if (!guard.acquired()) return Busy(fn);
      if (trainer->cancel.exchange(false)) return Cancelled(fn);
      if (sg_status* s = Agree(fn, trainer, nullptr)) return s;
      sg::Model& model = trainer->trainer->model();
      sg::ScopedThreads threads(trainer->trainer->num_threads());
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status s = TakeHandleValues(trainer); !s.ok()) return FromAbslIn(fn, s);
      model.memory().ResetPeak();
      absl::StatusOr<sg::EvalResult> r = sg::Evaluate(model, set, trainer->trainer->strategy());
      if (!r.ok()) {
        if (r.status().code() == absl::StatusCode::kCancelled) trainer->cancel.store(false);
        return FromAbslIn(fn, r.status());
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      FillEvalResult(*r, model.memory().Snapshot().total_peak, secs, out);
      return nullptr;
    });
  });
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_eval_result sg_eval_result_init(void) {
  sg_eval_result r{};
  r.struct_size = sizeof(sg_eval_result);
  return r;
}

sg_status* sg_trainer_evaluate_detailed(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                        int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                        const int64_t* distances, sg_eval_result* out) {
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return EvaluateDetailed("sg_trainer_evaluate_detailed", trainer, &b, distances, out);
}

sg_status* sg_trainer_evaluate_detailed_batch(sg_trainer* trainer, const sg_batch* batch, const int64_t* distances,
                                              sg_eval_result* out) {
  return EvaluateDetailed("sg_trainer_evaluate_detailed_batch", trainer, batch, distances, out);
}

}  // extern "C"
