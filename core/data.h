// Training data: the built-in synthetic long-range retrieval task and real token files (.bin, JSONL).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/objective.h"
#include "core/strategy.h"

namespace sg {

// Key-value retrieval. Pair tokens, each standing for one (key, value), are scattered over a long sequence of
// filler tokens; a block of (QUERY key) queries ends the sequence, labelled with the value paired with that key.
// The loss falls below log(num_values) only by attending back to where the key's pair token appeared.
// Token ids: 0 unused, 1 query mark, then keys, values, pair tokens (key-major), filler.
struct RetrievalTask {
  int64_t seq_len = 4096;
  int64_t vocab = 128;
  int64_t num_keys = 16;
  int64_t num_values = 4;
  int64_t num_queries = 128;  // keys are queried in random order, each several times

  static constexpr int32_t kQueryMark = 1;
  static constexpr int32_t kFirstKey = 2;

  absl::Status Validate() const;
  // Deterministic in (seed, index). distances (if not null) gets, per labelled position, the distance between
  // the query and its key's pair token.
  Sequence Make(uint64_t seed, int64_t index, std::vector<int64_t>* distances = nullptr) const;
};

// Headerless little-endian uint16 or uint32 token ids (a regular file, refused before reading when the host lacks
// the memory to hold it), cut into windows of seq_len + 1 tokens (inputs and
// next-token labels). A final shorter window (>= 2 tokens) is kept as a ragged sequence. doc_sep_token >= 0
// (--doc_sep_token, e.g. the EOS id): a document ends after each such token (Sequence::doc_starts); -1: one stream.
absl::StatusOr<std::vector<Sequence>> LoadTokenBin(const std::string& path, int bytes_per_token, int64_t seq_len,
                                                   int64_t vocab, int64_t doc_sep_token = -1);

// JSONL lines longer than this are refused (the --max_line_bytes default): a line's JSON takes ~15x its bytes.
constexpr int64_t kDefaultMaxLineBytes = int64_t{64} << 20;

// The JSONL readers below read in blocks, refuse a line longer than max_line_bytes, a NUL byte, duplicate keys and
// anything but a regular file; errors name the file and line.

// What LoadJsonl does with a record of more than seq_len + 1 tokens (a record of n tokens trains n - 1 positions):
// refuse it (an error naming the first such record's file, line and lengths, and how many there are), truncate it
// (keep its first seq_len + 1 tokens) or split it into windows of seq_len + 1 tokens that overlap by one (every
// label is trained once, as in .bin windows). A cut piece left without any label (all -100) is dropped.
enum class Overlong { kRefuse, kTruncate, kSplit };
// "refuse", "truncate" or "split" (--overlong).
absl::StatusOr<Overlong> ParseOverlong(const std::string& name);

// What LoadJsonl made of a file.
struct JsonlCounts {
  int64_t records = 0;     // non-blank lines
  int64_t sequences = 0;   // sequences returned
  int64_t truncated = 0;   // records cut at seq_len + 1 tokens
  int64_t split = 0;       // records cut into several sequences
  int64_t tokens_cut = 0;  // tokens truncation threw away
  int64_t dropped = 0;     // cut pieces without any label
  // "40 records; 3 truncated (744 tokens cut)", "40 records -> 46 sequences; 3 split", ...
  std::string Summary() const;
};

// One JSON object per line: {"input_ids": [...], "labels": [...]} (labels optional, Hugging Face convention:
// same length as input_ids, not shifted, -100 = ignored). Packed documents (Sequence::doc_starts) by the optional
// "doc_lengths" (summing to len(input_ids)) and/or "position_ids" (Hugging Face's flattening: a document starts where
// the position is 0, each other one is the previous + 1); both given must agree. Records longer than seq_len + 1
// tokens: see Overlong (the pieces keep their parts of the documents).
absl::StatusOr<std::vector<Sequence>> LoadJsonl(const std::string& path, int64_t seq_len, int64_t vocab,
                                                int64_t max_line_bytes = kDefaultMaxLineBytes,
                                                Overlong overlong = Overlong::kRefuse, JsonlCounts* counts = nullptr);

// DPO preference pairs, one JSON object per line:
//   {"prompt": [ids], "chosen": [ids], "rejected": [ids], "ref_chosen_logp": x, "ref_rejected_logp": y}
// Each response becomes a sequence over prompt + response whose labels are the response tokens only (next-token
// aligned). The two ref_* fields (sums of the reference model's log-probs over the response) are optional
// together: without them the trainer needs a reference model. Errors name the file, line and field.
absl::StatusOr<std::vector<DpoPair>> LoadDpoJsonl(const std::string& path, int64_t vocab,
                                                  int64_t max_line_bytes = kDefaultMaxLineBytes);

// GRPO groups, one prompt per line:
//   {"prompt": [ids], "completions": [[ids], ...], "advantages": [a, ...],
//    "old_logprobs": [[...], ...], "ref_logprobs": [[...], ...]}
// G = len(completions) >= 1 completions with one advantage each; the optional per-token arrays hold, for each
// completion token, its log-prob under the old policy / the reference model (same length as the completion).
absl::StatusOr<std::vector<GrpoGroup>> LoadGrpoJsonl(const std::string& path, int64_t vocab,
                                                     int64_t max_line_bytes = kDefaultMaxLineBytes);

// Checks ids against the vocabulary, that the sequence is not empty and its documents (Sequence::doc_starts:
// ascending from 0, inside the sequence, no label crossing a start); the message names `source`.
absl::Status ValidateSequence(const Sequence& s, int64_t vocab, const std::string& source);

// Makes s a sequence of packed documents of the given lengths in tokens, as given with its ids (which hold their sum,
// less the final label-only token): doc_starts from the lengths, and the label of each document's last position (the
// first token of the next document) -100. One length or none: one document. The message names `source`.
absl::Status SetDocuments(Sequence& s, const std::vector<int64_t>& lengths, const std::string& source);
// SetDocuments with documents of doc_len tokens (>= 1), the last one taking the rest (benchmarks and plans).
absl::Status SetDocumentsOfLength(Sequence& s, int64_t doc_len, const std::string& source);

}  // namespace sg
