// Batches: the C API's token arrays, checked, into the engine's sequences.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"
#include "core/data.h"

namespace sg::cabi {

Sequence EngineSequence(const int32_t* ids, const int32_t* hf, int64_t n) {
  const int32_t* src = hf ? hf : ids;
  Sequence q;
  q.ids.assign(ids, ids + n - 1);
  q.labels.assign(src + 1, src + n);
  q.last_token = ids[n - 1];
  return q;
}

std::vector<Sequence> WithPositions(std::vector<Sequence> batch) {
  batch.erase(std::remove_if(batch.begin(), batch.end(), [](const Sequence& q) { return q.ids.empty(); }), batch.end());
  return batch;
}

sg_batch FlatBatch(const int32_t* ids, const int32_t* labels, int64_t num_tokens, const int64_t* lengths,
                   int64_t num_sequences) {
  sg_batch b = sg_batch_init();
  b.ids = ids;
  b.labels = labels;
  b.num_tokens = num_tokens;
  b.lengths = lengths;
  b.num_sequences = num_sequences;
  return b;
}

sg_status* CheckBatch(const char* fn, const sg_batch* b) {
  if (!b) return NullArg(fn, "batch");
  return CheckStructSize(fn, "batch", b->struct_size, sizeof(sg_batch));
}

namespace {

// Sequence s's documents (b.num_documents[s] lengths of b.doc_lengths from offset *first) onto q, checked and named
// as doc_lengths[s][d]; *first moves past them.
sg_status* ApplyDocuments(const char* fn, const sg_batch& b, int64_t s, int64_t* first, Sequence* q) {
  const int64_t count = b.num_documents[s];
  if (count < 0 || count > b.lengths[s])
    return Invalid(absl::StrCat(fn, ": num_documents[", s, "] = ", count, "; need 0 to lengths[", s,
                                "] = ", b.lengths[s], " documents"));
  if (count == 0) return nullptr;
  if (!b.doc_lengths) return NullArg(fn, "doc_lengths");
  const int64_t* lengths = b.doc_lengths + *first;
  int64_t sum = 0;
  for (int64_t d = 0; d < count; ++d) {
    if (lengths[d] < 1 || lengths[d] > b.lengths[s] - sum)
      return Invalid(absl::StrCat(fn, ": doc_lengths[", s, "][", d, "] = ", lengths[d], "; sequence ", s,
                                  "'s documents need >= 1 token each and sum to lengths[", s, "] = ", b.lengths[s]));
    sum += lengths[d];
  }
  if (sum != b.lengths[s])
    return Invalid(absl::StrCat(fn, ": doc_lengths[", s, "] sums to ", sum, " but lengths[", s, "] is ", b.lengths[s]));
  *first += count;
  const absl::Status st =
      SetDocuments(*q, std::vector<int64_t>(lengths, lengths + count), absl::StrCat("sequence ", s));
  return st.ok() ? nullptr : FromAbslIn(fn, st);
}

}  // namespace

sg_status* BuildBatch(const char* fn, int64_t vocab, const sg_batch& b, std::vector<Sequence>* batch,
                      bool allow_unlabelled) {
  const int32_t *ids = b.ids, *labels = b.labels;
  const int64_t* lengths = b.lengths;
  const int64_t num_tokens = b.num_tokens, num_sequences = b.num_sequences;
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
  int64_t off = 0, first_document = 0;
  bool any_label = false;
  for (int64_t s = 0; s < num_sequences; ++s) {
    Sequence& q = (*batch)[s];
    const int64_t n = lengths[s];
    q = EngineSequence(ids + off, labels ? labels + off : nullptr, n);
    if (b.num_documents)
      if (sg_status* st = ApplyDocuments(fn, b, s, &first_document, &q)) return st;
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

extern "C" sg_batch sg_batch_init(void) {
  sg_batch b{};
  b.struct_size = sizeof(sg_batch);
  return b;
}
