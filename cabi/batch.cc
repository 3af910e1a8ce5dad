// Batches: the C API's token arrays, checked, into the engine's sequences.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {

Sequence EngineSequence(const int32_t* ids, const int32_t* hf, int64_t n) {
  const int32_t* src = hf ? hf : ids;
  Sequence q;
  q.ids.assign(ids, ids + n - 1);
  q.labels.assign(src + 1, src + n);
  return q;
}

std::vector<Sequence> WithPositions(std::vector<Sequence> batch) {
  batch.erase(std::remove_if(batch.begin(), batch.end(), [](const Sequence& q) { return q.ids.empty(); }), batch.end());
  return batch;
}

sg_status* BuildBatch(const char* fn, int64_t vocab, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                      const int64_t* lengths, int64_t num_sequences, std::vector<Sequence>* batch,
                      bool allow_unlabelled) {
  if (!ids) return NullArg(fn, "ids");
  if (!lengths) return NullArg(fn, "lengths");
  if (num_sequences <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_sequences' is ", num_sequences, "; need at least 1 sequence"));
  if (num_tokens <= 0) return Invalid(absl::StrCat(fn, ": argument 'num_tokens' is ", num_tokens, "; need >= 1"));
  for (int64_t i = 0; i < num_sequences; ++i)  // all of them before the sum, which a negative one would hide
    if (lengths[i] <= 0)
      return Invalid(absl::StrCat(fn, ": lengths[", i, "] is ", lengths[i], "; every sequence needs >= 1 token"));
  int64_t sum = 0;  // <= num_tokens: never overflows
  for (int64_t i = 0; i < num_sequences; ++i) {
    if (lengths[i] > num_tokens - sum)
      return Invalid(absl::StrCat(fn, ": argument 'lengths' sums to more than 'num_tokens' (", num_tokens,
                                  ") at lengths[", i, "] = ", lengths[i]));
    sum += lengths[i];
  }
  if (sum != num_tokens)
    return Invalid(absl::StrCat(fn, ": argument 'lengths' sums to ", sum, " but 'num_tokens' is ", num_tokens));
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab)
      return Invalid(absl::StrCat(fn, ": ids[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")"));
    if (labels && labels[i] != -100 && (labels[i] < 0 || labels[i] >= vocab))
      return Invalid(absl::StrCat(fn, ": labels[", i, "] = ", labels[i], " is neither -100 nor in [0, ", vocab, ")"));
  }
  batch->resize(num_sequences);
  int64_t off = 0;
  bool any_label = false;
  for (int64_t s = 0; s < num_sequences; ++s) {
    Sequence& q = (*batch)[s];
    const int64_t n = lengths[s];
    q = EngineSequence(ids + off, labels ? labels + off : nullptr, n);
    for (int32_t l : q.labels) any_label |= l >= 0;
    off += n;
  }
  if (!any_label && !allow_unlabelled)
    return Invalid(absl::StrCat(fn,
                                labels ? ": argument 'labels' has no label (not -100) at a position >= 1 of any "
                                         "sequence (position 0 is never predicted)"
                                       : ": every sequence has length 1, so there are no next-token labels",
                                "; the loss is undefined"));
  return nullptr;
}

sg_status* BuildSequence(const char* fn, int64_t vocab, const SequenceArgs& a, int64_t i, Sequence* out) {
  const int32_t* ids = a.ids[i];
  const int32_t* labels = a.labels ? a.labels[i] : nullptr;
  const int64_t n = a.lengths[i];
  if (n <= 0)
    return Invalid(absl::StrCat(fn, ": ", a.lengths_name, "[", i, "] is ", n, "; every sequence needs >= 1 token"));
  if (!ids) return Invalid(absl::StrCat(fn, ": argument '", a.ids_name, "[", i, "]' is NULL"));
  for (int64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= vocab)
      return Invalid(absl::StrCat(fn, ": ", a.ids_name, "[", i, "][", k, "] = ", ids[k],
                                  " is outside the vocabulary [0, ", vocab, ")"));
    if (labels && labels[k] != -100 && (labels[k] < 0 || labels[k] >= vocab))
      return Invalid(absl::StrCat(fn, ": ", a.labels_name, "[", i, "][", k, "] = ", labels[k],
                                  " is neither -100 nor in [0, ", vocab, ")"));
  }
  *out = EngineSequence(ids, labels, n);
  for (int32_t l : out->labels)
    if (l >= 0) return nullptr;
  if (labels)
    return Invalid(absl::StrCat(fn, ": ", a.labels_name, "[", i,
                                "] has no label (not -100) at a position >= 1 "
                                "(position 0 is never predicted); the loss is undefined"));
  return Invalid(absl::StrCat(fn, ": ", a.lengths_name, "[", i,
                              "] is 1, so there are no next-token labels; the loss is undefined"));
}

}  // namespace sg::cabi
