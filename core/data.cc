#include "core/data.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "base/memory.h"
#include "core/io/file.h"
#include "core/io/json_util.h"
#include "nlohmann/json.hpp"

namespace sg {

absl::Status RetrievalTask::Validate() const {
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  // A sequence is generated whole: tokens, labels and positions, 16 bytes per token.
  if (const int64_t available = HostAvailableBytes(); available >= 0 && seq_len > available / 16)
    return absl::ResourceExhaustedError(absl::StrCat("--seq_len=", seq_len, ": a synthetic sequence needs ",
                                                     seq_len > INT64_MAX / 16 ? "more than 2^63" : absl::StrCat(seq_len * 16),
                                                     " bytes and ", available, " bytes are available"));
  const int64_t filler = vocab - kFirstKey - num_keys - num_values - num_keys * num_values;
  if (filler < 1)
    return absl::InvalidArgumentError(absl::StrCat("retrieval task: vocab ", vocab, " too small for ", num_keys,
                                                   " keys and ", num_values, " values"));
  if (seq_len < num_keys + 4 * num_queries)
    return absl::InvalidArgumentError(absl::StrCat("retrieval task: --seq_len ", seq_len, " too short for ",
                                                   num_keys, " keys and ", num_queries, " queries (need >= ",
                                                   num_keys + 4 * num_queries, ")"));
  return absl::OkStatus();
}

Sequence RetrievalTask::Make(uint64_t seed, int64_t index, std::vector<int64_t>* distances) const {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index));
  const int32_t first_value = static_cast<int32_t>(kFirstKey + num_keys);
  const int32_t first_pair = static_cast<int32_t>(first_value + num_values);
  const int32_t first_filler = static_cast<int32_t>(first_pair + num_keys * num_values);
  std::uniform_int_distribution<int32_t> filler(first_filler, static_cast<int32_t>(vocab - 1));
  std::uniform_int_distribution<int32_t> value(0, static_cast<int32_t>(num_values - 1));

  std::vector<int32_t> tok(seq_len);
  for (int32_t& t : tok) t = filler(rng);
  const int64_t query_start = seq_len - 2 * num_queries;
  std::vector<int64_t> pos(query_start);
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng);
  std::vector<int32_t> key_value(num_keys);
  for (int64_t k = 0; k < num_keys; ++k) {
    key_value[k] = value(rng);
    tok[pos[k]] = static_cast<int32_t>(first_pair + k * num_values + key_value[k]);
  }
  std::uniform_int_distribution<int64_t> query_key(0, num_keys - 1);

  Sequence s;
  s.labels.assign(seq_len, -100);
  if (distances) distances->clear();
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t k = query_key(rng), p = query_start + 2 * i;
    tok[p] = kQueryMark;
    tok[p + 1] = static_cast<int32_t>(kFirstKey + k);
    s.labels[p + 1] = first_value + key_value[k];  // at the query's key, predict the value
    if (distances) distances->push_back(p + 1 - pos[k]);
  }
  s.ids = std::move(tok);
  return s;
}

absl::Status ValidateSequence(const Sequence& s, int64_t vocab, const std::string& source) {
  if (s.ids.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": empty sequence"));
  if (s.labels.size() != s.ids.size())
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.labels.size(), " labels for ", s.ids.size(),
                                                   " input ids"));
  for (size_t i = 0; i < s.ids.size(); ++i) {
    if (s.ids[i] < 0 || s.ids[i] >= vocab)
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": input id ", s.ids[i], " at position ", i, " is outside the vocabulary [0, ", vocab, ")"));
    if (s.labels[i] >= vocab || (s.labels[i] < 0 && s.labels[i] != -100))
      return absl::InvalidArgumentError(absl::StrCat(source, ": label ", s.labels[i], " at position ", i,
                                                     " is outside the vocabulary [0, ", vocab, ") and not -100"));
  }
  const int64_t n = static_cast<int64_t>(s.ids.size());
  for (size_t d = 0; d < s.doc_starts.size(); ++d) {
    const int64_t start = s.doc_starts[d];
    if (d == 0 ? start != 0 : start <= s.doc_starts[d - 1] || start >= n)
      return absl::InvalidArgumentError(absl::StrCat(source, ": document ", d, " starts at position ", start,
                                                     "; documents start at 0, in increasing order, inside the ", n,
                                                     " positions"));
    if (d > 0 && s.labels[start - 1] != -100)
      return absl::InvalidArgumentError(absl::StrCat(source, ": the label at position ", start - 1,
                                                     " crosses into document ", d, " (it must be -100)"));
  }
  return absl::OkStatus();
}

absl::Status SetDocumentsOfLength(Sequence& s, int64_t doc_len, const std::string& source) {
  if (doc_len < 1) return absl::InvalidArgumentError(absl::StrCat(source, ": documents of ", doc_len, " tokens"));
  const int64_t tokens = static_cast<int64_t>(s.ids.size()) + 1;  // the last token is only a label
  std::vector<int64_t> lengths(tokens / doc_len, doc_len);
  if (tokens % doc_len) lengths.push_back(tokens % doc_len);
  return SetDocuments(s, lengths, source);
}

absl::Status SetDocuments(Sequence& s, const std::vector<int64_t>& lengths, const std::string& source) {
  const int64_t n = static_cast<int64_t>(s.ids.size());
  int64_t total = 0;
  for (size_t d = 0; d < lengths.size(); ++d) {
    if (lengths[d] < 1)
      return absl::InvalidArgumentError(absl::StrCat(source, ": document ", d, " has length ", lengths[d],
                                                     "; need >= 1"));
    total += lengths[d];
  }
  if (!lengths.empty() && total != n + 1)
    return absl::InvalidArgumentError(absl::StrCat(source, ": the document lengths sum to ", total, " tokens, not the ",
                                                   n + 1, " of the sequence"));
  s.doc_starts.clear();
  if (lengths.size() < 2) return absl::OkStatus();
  int64_t start = 0;
  for (size_t d = 0; d < lengths.size(); ++d) {
    if (d > 0) s.labels[start - 1] = -100;  // position start - 1 would learn this document's first token
    if (start < n) s.doc_starts.push_back(start);  // (a last document of one token is only a label)
    start += lengths[d];
  }
  return absl::OkStatus();
}

namespace {
// Inputs tok[0..n-1), labels shifted by one (the HF causal-LM convention); labels may be given or taken from tok.
Sequence Shifted(const std::vector<int32_t>& tok, const std::vector<int32_t>& labels) {
  Sequence s;
  s.ids.assign(tok.begin(), tok.end() - 1);
  s.labels.assign(labels.begin() + 1, labels.end());
  s.last_token = tok.back();
  return s;
}

// The tokens [b, e) of a record whose documents start at `starts` (ascending, from 0) as a sequence of documents:
// the lengths of the documents cut to [b, e), given to SetDocuments.
absl::Status SetPieceDocuments(Sequence& s, const std::vector<int64_t>& starts, int64_t b, int64_t e,
                               const std::string& source) {
  if (starts.size() < 2) return absl::OkStatus();
  std::vector<int64_t> lengths;
  int64_t from = b;
  for (auto it = std::upper_bound(starts.begin(), starts.end(), b); it != starts.end() && *it < e; ++it) {
    lengths.push_back(*it - from);
    from = *it;
  }
  lengths.push_back(e - from);
  return SetDocuments(s, lengths, source);
}
}  // namespace

absl::StatusOr<std::vector<Sequence>> LoadTokenBin(const std::string& path, int bytes_per_token, int64_t seq_len,
                                                   int64_t vocab, int64_t doc_sep_token) {
  if (bytes_per_token != 2 && bytes_per_token != 4)
    return absl::InvalidArgumentError("--data_dtype must be uint16 or uint32");
  if (doc_sep_token < -1 || doc_sep_token >= vocab)
    return absl::InvalidArgumentError(absl::StrCat("--doc_sep_token=", doc_sep_token,
                                                   " is outside the vocabulary [0, ", vocab, ") and not -1 (none)"));
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  struct stat info;
  absl::StatusOr<io::ReadFd> fd = io::OpenRegularFile(path, &info);
  if (!fd.ok()) return fd.status();
  const int64_t size = info.st_size;
  if (size % bytes_per_token != 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": size ", size, " is not a multiple of ",
                                                   bytes_per_token, " bytes per token"));
  const int64_t count = size / bytes_per_token;
  if (count < 2) return absl::InvalidArgumentError(absl::StrCat(path, ": fewer than 2 tokens"));
  // Held as int32 tokens, then as windows of inputs and labels: 12 bytes per token, refused up front when the
  // host does not have them.
  if (const int64_t available = HostAvailableBytes(); available >= 0 && count > available / 12)
    return absl::ResourceExhaustedError(absl::StrCat(path, ": ", count, " tokens need ", count * 12,
                                                     " bytes of memory to load and ", available,
                                                     " bytes are available"));
  std::vector<int32_t> tok(count);
  std::vector<unsigned char> block(size_t{1} << 20);
  for (int64_t i = 0; i < count;) {
    const int64_t n = std::min<int64_t>(count - i, static_cast<int64_t>(block.size()) / bytes_per_token);
    size_t got = 0;
    if (!io::ReadFully(fd->get(), block.data(), static_cast<size_t>(n * bytes_per_token), &got))
      return ErrnoStatus(errno, absl::StrCat(path, ": read failed"));
    if (got != static_cast<size_t>(n * bytes_per_token))
      return absl::DataLossError(absl::StrCat(path, ": the file shrank while it was read"));
    for (int64_t k = 0; k < n; ++k, ++i) {
      uint32_t v = 0;
      for (int b = 0; b < bytes_per_token; ++b) v |= static_cast<uint32_t>(block[k * bytes_per_token + b]) << (8 * b);
      if (v >= static_cast<uint64_t>(vocab))
        return absl::InvalidArgumentError(absl::StrCat(path, ": token id ", v, " at index ", i,
                                                       " is outside the vocabulary [0, ", vocab, ")"));
      tok[i] = static_cast<int32_t>(v);
    }
  }
  std::vector<int64_t> starts = {0};  // a document ends after each separator
  if (doc_sep_token >= 0)
    for (int64_t i = 0; i + 1 < count; ++i)
      if (tok[i] == doc_sep_token) starts.push_back(i + 1);
  std::vector<Sequence> out;
  for (int64_t b = 0; b + 1 < count; b += seq_len) {
    const int64_t e = std::min(count, b + seq_len + 1);
    std::vector<int32_t> window(tok.begin() + b, tok.begin() + e);
    out.push_back(Shifted(window, window));
    if (absl::Status s = SetPieceDocuments(out.back(), starts, b, e, path); !s.ok()) return s;
  }
  return out;
}

namespace {

// A JSON value in a few words for an error message: numbers, booleans and short strings as written, else the type.
std::string Describe(const nlohmann::json& v) {
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  if (v.is_string()) {
    const std::string s = v.dump();
    return s.size() <= 40 ? absl::StrCat("the string ", s) : "a string";
  }
  return absl::StrCat("a", v.is_array() || v.is_object() ? "n " : " ", v.type_name());
}

// One non-blank line of a JSONL file, parsed to an object, with typed readers of its fields. Every error names the
// file, the line and the field: "<path>:<line>: field '<field>' ...", nested values as 'completions[2][0]'.
class JsonLine {
 public:
  JsonLine(std::string where, nlohmann::json obj) : where_(std::move(where)), obj_(std::move(obj)) {}
  const std::string& where() const { return where_; }
  const nlohmann::json& obj() const { return obj_; }

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": field '", field, "' ", what));
  }
  // The field's value; null where an optional field is absent or JSON null.
  absl::StatusOr<const nlohmann::json*> Field(const char* field, bool required) const {
    const auto it = obj_.find(field);
    if (it != obj_.end() && !it->is_null()) return &*it;
    if (required) return Error(field, it == obj_.end() ? "is missing" : "is null");
    return nullptr;
  }
  // An array; `count` >= 0 asks for that many elements (`count_what` says why).
  absl::Status Array(const nlohmann::json& v, const std::string& field, int64_t count = -1,
                     const std::string& count_what = "") const {
    if (!v.is_array()) return Error(field, absl::StrCat("must be an array, got ", Describe(v)));
    if (count >= 0 && static_cast<int64_t>(v.size()) != count)
      return Error(field, absl::StrCat("has ", v.size(), " entries for ", count_what));
    return absl::OkStatus();
  }
  // A non-empty array of token ids in [0, vocab); `role` says what the tokens are for the empty case.
  absl::Status Ids(const nlohmann::json& v, const std::string& field, int64_t vocab, const char* role,
                   std::vector<int32_t>* out) const {
    if (!v.is_array()) return Error(field, absl::StrCat("must be an array of token ids, got ", Describe(v)));
    if (v.empty()) return Error(field, absl::StrCat("is empty: ", role, " needs at least one token"));
    out->clear();
    out->reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const nlohmann::json& e = v[i];
      const std::string name = absl::StrCat(field, "[", i, "]");
      if (!e.is_number_integer()) return Error(name, absl::StrCat("must be an integer token id, got ", Describe(e)));
      const bool in_vocab = e.is_number_unsigned() ? e.get<uint64_t>() < static_cast<uint64_t>(vocab)
                                                   : e.get<int64_t>() >= 0 && e.get<int64_t>() < vocab;
      if (!in_vocab) return Error(name, absl::StrCat("is ", e.dump(), ", outside the vocabulary [0, ", vocab, ")"));
      out->push_back(static_cast<int32_t>(e.get<int64_t>()));
    }
    return absl::OkStatus();
  }
  // Labels: integers in [0, vocab) or -100 (ignored), as many as `count`.
  absl::Status Labels(const nlohmann::json& v, const std::string& field, int64_t vocab, size_t count,
                      std::vector<int32_t>* out) const {
    if (!v.is_array()) return Error(field, absl::StrCat("must be an array of labels, got ", Describe(v)));
    if (v.size() != count) return Error(field, absl::StrCat("has ", v.size(), " labels for ", count, " input ids"));
    out->clear();
    out->reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const nlohmann::json& e = v[i];
      const std::string name = absl::StrCat(field, "[", i, "]");
      if (!e.is_number_integer()) return Error(name, absl::StrCat("must be an integer label, got ", Describe(e)));
      // Unsigned values are all >= 0: compared as such, never reinterpreted as int64.
      const bool ok = e.is_number_unsigned() ? e.get<uint64_t>() < static_cast<uint64_t>(vocab)
                                             : e.get<int64_t>() == -100 ||
                                                   (e.get<int64_t>() >= 0 && e.get<int64_t>() < vocab);
      if (!ok)
        return Error(name, absl::StrCat("is ", e.dump(), ": a label must be -100 (ignored) or in the vocabulary [0, ",
                                        vocab, ")"));
      out->push_back(static_cast<int32_t>(e.get<int64_t>()));
    }
    return absl::OkStatus();
  }
  absl::Status Number(const nlohmann::json& v, const std::string& field, double* out) const {
    if (!v.is_number()) return Error(field, absl::StrCat("must be a number, got ", Describe(v)));
    *out = v.get<double>();
    if (!std::isfinite(*out)) return Error(field, absl::StrCat("is not finite (", *out, ")"));
    return absl::OkStatus();
  }
  // An array of finite numbers; count as for Array.
  absl::Status Numbers(const nlohmann::json& v, const std::string& field, int64_t count, const std::string& count_what,
                       std::vector<double>* out) const {
    if (absl::Status s = Array(v, field, count, count_what); !s.ok()) return s;
    out->resize(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      if (absl::Status s = Number(v[i], absl::StrCat(field, "[", i, "]"), &(*out)[i]); !s.ok()) return s;
    return absl::OkStatus();
  }

 private:
  std::string where_;
  nlohmann::json obj_;
};

// A JSON parse error of one line as "malformed JSON at column N: what" (or "malformed JSON: what").
std::string MalformedJson(absl::string_view message) {
  std::string inner(message);
  const std::string kPrefix = "not valid JSON (";
  if (inner.rfind(kPrefix, 0) != 0) return inner;  // e.g. duplicate key, nesting
  inner = inner.substr(kPrefix.size(), inner.size() - kPrefix.size() - 1);
  if (size_t p = inner.find(", column "); p != std::string::npos) {
    const size_t colon = inner.find(": ", p);
    if (colon != std::string::npos)
      return absl::StrCat("malformed JSON at column ", inner.substr(p + 9, colon - p - 9), ": ", inner.substr(colon + 2));
  }
  return absl::StrCat("malformed JSON: ", inner);
}

// Calls fn on every non-blank line of a JSONL file, stopping at the first error (a malformed line or fn's). Reads
// in blocks: a line longer than max_line_bytes is refused without holding more of it.
absl::Status ForEachJsonLine(const std::string& path, int64_t max_line_bytes,
                             const std::function<absl::Status(const JsonLine&)>& fn) {
  if (max_line_bytes <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--max_line_bytes must be positive, got ", max_line_bytes));
  absl::StatusOr<io::ReadFd> fd = io::OpenRegularFile(path);
  if (!fd.ok()) return fd.status();
  std::vector<char> block(size_t{1} << 16);
  size_t begin = 0, end = 0;  // unread bytes of block
  bool eof = false;
  std::string line;
  for (int64_t lineno = 1;; ++lineno) {
    line.clear();
    bool have_line = false;
    while (!have_line) {
      if (begin == end) {
        if (eof) break;
        size_t got = 0;
        if (!io::ReadFully(fd->get(), block.data(), block.size(), &got))
          return ErrnoStatus(errno, absl::StrCat(path, ":", lineno, ": read failed"));
        begin = 0;
        end = got;
        eof = got < block.size();
        if (got == 0) break;
      }
      const char* nl = static_cast<const char*>(std::memchr(block.data() + begin, '\n', end - begin));
      const size_t stop = nl ? static_cast<size_t>(nl - block.data()) : end;
      if (static_cast<int64_t>(line.size() + (stop - begin)) > max_line_bytes)
        return absl::InvalidArgumentError(absl::StrCat(path, ":", lineno, ": line is longer than ", max_line_bytes,
                                                       " bytes (--max_line_bytes)"));
      line.append(block.data() + begin, stop - begin);
      begin = nl ? stop + 1 : end;
      have_line = nl != nullptr;
    }
    if (!have_line && line.empty()) break;  // end of file
    const std::string where = absl::StrCat(path, ":", lineno);
    if (const size_t nul = line.find('\0'); nul != std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat(where, ": NUL byte at column ", nul + 1));
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    absl::StatusOr<nlohmann::json> j = io::internal::ParseJson(line);
    if (!j.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", MalformedJson(j.status().message())));
    if (!j->is_object())
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object, got ", Describe(*j)));
    if (absl::Status s = fn(JsonLine(where, *std::move(j))); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// One record per non-blank line, parsed by `parse`; an error for a file without any. `what` names the records.
template <typename T>
absl::StatusOr<std::vector<T>> LoadRecords(const std::string& path, const char* what, int64_t max_line_bytes,
                                           const std::function<absl::StatusOr<T>(const JsonLine&)>& parse) {
  std::vector<T> out;
  absl::Status st = ForEachJsonLine(path, max_line_bytes, [&](const JsonLine& line) -> absl::Status {
    absl::StatusOr<T> record = parse(line);
    if (!record.ok()) return record.status();
    out.push_back(std::move(*record));
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no ", what, " (the file has no non-blank lines)"));
  return out;
}

absl::Status CheckVocab(int64_t vocab) {
  if (vocab <= 0 || vocab > std::numeric_limits<int32_t>::max())
    return absl::InvalidArgumentError(absl::StrCat("vocab must be in [1, 2^31), got ", vocab));
  return absl::OkStatus();
}

// prompt + response as one sequence labelled on the response only: inputs full[0, n-1), label i = full[i+1] where
// i+1 is a response position, -100 elsewhere.
Sequence PromptResponse(const std::vector<int32_t>& prompt, const std::vector<int32_t>& response) {
  std::vector<int32_t> full = prompt;
  full.insert(full.end(), response.begin(), response.end());
  std::vector<int32_t> labels(full.size(), -100);
  std::copy(response.begin(), response.end(), labels.begin() + prompt.size());
  return Shifted(full, labels);
}

// Where a record's documents start (ascending, from 0), from its optional "position_ids" (Hugging Face's
// flattening convention: a document starts where the position is 0) and "doc_lengths" (summing to the record's
// n tokens); both given must agree. Neither: {0}, one document.
absl::StatusOr<std::vector<int64_t>> ReadDocumentStarts(const JsonLine& line, int64_t n) {
  std::vector<int64_t> from_positions, from_lengths;
  absl::StatusOr<const nlohmann::json*> positions = line.Field("position_ids", /*required=*/false);
  if (!positions.ok()) return positions.status();
  if (*positions) {
    const nlohmann::json& v = **positions;
    if (absl::Status s = line.Array(v, "position_ids", n, absl::StrCat(n, " input ids")); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      const nlohmann::json& e = v[i];
      const int64_t want = i == 0 ? 0 : v[i - 1].get<int64_t>() + 1;
      if (!e.is_number_integer() || (e.get<int64_t>() != 0 && (i == 0 || e.get<int64_t>() != want)))
        return line.Error(absl::StrCat("position_ids[", i, "]"),
                          absl::StrCat("is ", e.dump(), "; positions start at 0 and each is the previous + 1 (",
                                       want, ") or 0 (a new document)"));
      if (e.get<int64_t>() == 0) from_positions.push_back(i);
    }
  }
  absl::StatusOr<const nlohmann::json*> lengths = line.Field("doc_lengths", /*required=*/false);
  if (!lengths.ok()) return lengths.status();
  if (*lengths) {
    const nlohmann::json& v = **lengths;
    if (absl::Status s = line.Array(v, "doc_lengths"); !s.ok()) return s;
    int64_t start = 0;
    for (size_t d = 0; d < v.size(); ++d) {
      const nlohmann::json& e = v[d];
      if (!e.is_number_integer() || e.get<int64_t>() < 1 || e.get<int64_t>() > n - start)
        return line.Error(absl::StrCat("doc_lengths[", d, "]"),
                          absl::StrCat("is ", e.dump(), "; document lengths are >= 1 and sum to the ", n,
                                       " input ids (", n - start, " left)"));
      from_lengths.push_back(start);
      start += e.get<int64_t>();
    }
    if (start != n)
      return line.Error("doc_lengths", absl::StrCat("sums to ", start, ", not the ", n, " input ids"));
  }
  if (*positions && *lengths && from_positions != from_lengths)
    return line.Error("doc_lengths", absl::StrCat("starts documents at ", absl::StrJoin(from_lengths, ","),
                                                  " and 'position_ids' at ", absl::StrJoin(from_positions, ",")));
  if (*lengths) return from_lengths;
  if (*positions) return from_positions;
  return std::vector<int64_t>{0};
}

// Reads a required token-id field.
absl::Status ReadIds(const JsonLine& line, const char* field, int64_t vocab, const char* role,
                     std::vector<int32_t>* out) {
  absl::StatusOr<const nlohmann::json*> v = line.Field(field, /*required=*/true);
  if (!v.ok()) return v.status();
  return line.Ids(**v, field, vocab, role, out);
}

}  // namespace

absl::StatusOr<Overlong> ParseOverlong(const std::string& name) {
  if (name == "refuse") return Overlong::kRefuse;
  if (name == "truncate") return Overlong::kTruncate;
  if (name == "split") return Overlong::kSplit;
  return absl::InvalidArgumentError(absl::StrCat("--overlong must be refuse, truncate or split, got '", name, "'"));
}

std::string JsonlCounts::Summary() const {
  std::string out = absl::StrCat(records, " records");
  if (sequences != records) absl::StrAppend(&out, " -> ", sequences, " sequences");
  if (truncated > 0) absl::StrAppend(&out, "; ", truncated, " truncated (", tokens_cut, " tokens cut)");
  if (split > 0) absl::StrAppend(&out, "; ", split, " split");
  if (dropped > 0) absl::StrAppend(&out, "; ", dropped, dropped == 1 ? " cut piece" : " cut pieces", " without labels dropped");
  return out;
}

absl::StatusOr<std::vector<Sequence>> LoadJsonl(const std::string& path, int64_t seq_len, int64_t vocab,
                                                int64_t max_line_bytes, Overlong overlong, JsonlCounts* counts) {
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  if (absl::Status s = CheckVocab(vocab); !s.ok()) return s;
  const int64_t window = std::min<int64_t>(seq_len, INT32_MAX) + 1;  // tokens of one sequence
  JsonlCounts c;
  int64_t too_long = 0;
  std::string first_too_long;  // refuse: where the first over-long record is, and its length
  std::vector<Sequence> out;
  absl::Status st = ForEachJsonLine(path, max_line_bytes, [&](const JsonLine& line) -> absl::Status {
    std::vector<int32_t> ids, labels;
    if (absl::Status s = ReadIds(line, "input_ids", vocab, "a sequence", &ids); !s.ok()) return s;
    absl::StatusOr<const nlohmann::json*> given = line.Field("labels", /*required=*/false);
    if (!given.ok()) return given.status();
    if (*given) {
      if (absl::Status s = line.Labels(**given, "labels", vocab, ids.size(), &labels); !s.ok()) return s;
    } else {
      labels = ids;
    }
    if (ids.size() < 2) return line.Error("input_ids", "has fewer than 2 input ids");
    ++c.records;
    const int64_t n = static_cast<int64_t>(ids.size());
    absl::StatusOr<std::vector<int64_t>> starts = ReadDocumentStarts(line, n);
    if (!starts.ok()) return starts.status();
    if (n > window && overlong == Overlong::kRefuse) {
      if (too_long++ == 0)
        first_too_long = absl::StrCat(line.where(), ": field 'input_ids' has ", n, " tokens (", n - 1,
                                      " positions to train), more than --seq_len=", window - 1);
      return absl::OkStatus();
    }
    // The record whole, or its pieces: [b, b + window) from b = 0 in steps of window - 1 (split) or the first only.
    const bool cut = n > window;
    c.truncated += cut && overlong == Overlong::kTruncate;
    c.split += cut && overlong == Overlong::kSplit;
    if (cut && overlong == Overlong::kTruncate) c.tokens_cut += n - window;
    for (int64_t b = 0; b + 1 < n; b += window - 1) {
      const int64_t e = std::min(n, b + window);
      Sequence s = Shifted(std::vector<int32_t>(ids.begin() + b, ids.begin() + e),
                           std::vector<int32_t>(labels.begin() + b, labels.begin() + e));
      if (absl::Status d = SetPieceDocuments(s, *starts, b, e, line.where()); !d.ok()) return d;
      if (absl::Status v = ValidateSequence(s, vocab, line.where()); !v.ok()) return v;
      const bool learns = std::any_of(s.labels.begin(), s.labels.end(), [](int32_t l) { return l >= 0; });
      if (cut && !learns) ++c.dropped;
      else out.push_back(std::move(s));
      if (cut && overlong == Overlong::kTruncate) break;
    }
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  if (too_long > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        first_too_long, "; ", too_long, " of ", c.records, " records are longer than that: raise --seq_len, or pass "
        "--overlong=truncate (cut each at --seq_len) or --overlong=split (cut each into sequences of --seq_len)"));
  if (c.records == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": no sequences (the file has no non-blank lines)"));
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no sequences: every piece --overlong cut is without labels"));
  c.sequences = static_cast<int64_t>(out.size());
  if (counts) *counts = c;
  return out;
}

absl::StatusOr<std::vector<DpoPair>> LoadDpoJsonl(const std::string& path, int64_t vocab, int64_t max_line_bytes) {
  if (absl::Status s = CheckVocab(vocab); !s.ok()) return s;
  return LoadRecords<DpoPair>(path, "DPO pairs", max_line_bytes, [&](const JsonLine& line) -> absl::StatusOr<DpoPair> {
    std::vector<int32_t> prompt, chosen, rejected;
    if (absl::Status s = ReadIds(line, "prompt", vocab, "the prompt", &prompt); !s.ok()) return s;
    if (absl::Status s = ReadIds(line, "chosen", vocab, "a response", &chosen); !s.ok()) return s;
    if (absl::Status s = ReadIds(line, "rejected", vocab, "a response", &rejected); !s.ok()) return s;
    DpoPair pair;
    const char* names[2] = {"ref_chosen_logp", "ref_rejected_logp"};
    double* values[2] = {&pair.ref_chosen_logp, &pair.ref_rejected_logp};
    const nlohmann::json* refs[2];
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<const nlohmann::json*> v = line.Field(names[k], /*required=*/false);
      if (!v.ok()) return v.status();
      refs[k] = *v;
      if (refs[k])
        if (absl::Status s = line.Number(*refs[k], names[k], values[k]); !s.ok()) return s;
    }
    if (!refs[0] != !refs[1]) {
      const int missing = refs[0] ? 1 : 0;
      return line.Error(names[missing], absl::StrCat("is missing while '", names[1 - missing],
                                                     "' is given: give both reference log-probs or neither (then "
                                                     "the trainer takes them from a reference model)"));
    }
    pair.chosen = PromptResponse(prompt, chosen);
    pair.rejected = PromptResponse(prompt, rejected);
    return pair;
  });
}

absl::StatusOr<std::vector<GrpoGroup>> LoadGrpoJsonl(const std::string& path, int64_t vocab,
                                                     int64_t max_line_bytes) {
  if (absl::Status s = CheckVocab(vocab); !s.ok()) return s;
  return LoadRecords<GrpoGroup>(path, "GRPO groups", max_line_bytes, [&](const JsonLine& line) -> absl::StatusOr<GrpoGroup> {
    std::vector<int32_t> prompt;
    if (absl::Status s = ReadIds(line, "prompt", vocab, "the prompt", &prompt); !s.ok()) return s;
    absl::StatusOr<const nlohmann::json*> completions = line.Field("completions", /*required=*/true);
    if (!completions.ok()) return completions.status();
    if (absl::Status s = line.Array(**completions, "completions"); !s.ok()) return s;
    const int64_t G = static_cast<int64_t>((*completions)->size());
    if (G == 0) return line.Error("completions", "is empty: a group needs at least one completion (G >= 1)");
    std::vector<std::vector<int32_t>> tokens(G);
    for (int64_t i = 0; i < G; ++i)
      if (absl::Status s = line.Ids((**completions)[i], absl::StrCat("completions[", i, "]"), vocab, "a completion",
                                    &tokens[i]);
          !s.ok())
        return s;

    const std::string per_completion = absl::StrCat("G = ", G, " completions");
    absl::StatusOr<const nlohmann::json*> advantages = line.Field("advantages", /*required=*/true);
    if (!advantages.ok()) return advantages.status();
    std::vector<double> adv;
    if (absl::Status s = line.Numbers(**advantages, "advantages", G, per_completion, &adv); !s.ok()) return s;

    GrpoGroup group;
    group.completions.resize(G);
    for (int64_t i = 0; i < G; ++i) {
      group.completions[i].seq = PromptResponse(prompt, tokens[i]);
      group.completions[i].advantage = adv[i];
    }
    // Per-token log-probs, moved to the positions that predict the tokens: token j at len(prompt) - 1 + j.
    for (const char* field : {"old_logprobs", "ref_logprobs"}) {
      absl::StatusOr<const nlohmann::json*> v = line.Field(field, /*required=*/false);
      if (!v.ok()) return v.status();
      if (!*v) continue;
      if (absl::Status s = line.Array(**v, field, G, per_completion); !s.ok()) return s;
      for (int64_t i = 0; i < G; ++i) {
        std::vector<double> lp;
        if (absl::Status s = line.Numbers((**v)[i], absl::StrCat(field, "[", i, "]"),
                                          static_cast<int64_t>(tokens[i].size()),
                                          absl::StrCat("the ", tokens[i].size(), " tokens of completions[", i, "]"), &lp);
            !s.ok())
          return s;
        GrpoCompletion& c = group.completions[i];
        std::vector<double>& at = field[0] == 'o' ? c.old_logprobs : c.ref_logprobs;
        at.assign(c.seq.ids.size(), std::nan(""));
        std::copy(lp.begin(), lp.end(), at.begin() + (prompt.size() - 1));
      }
    }
    return group;
  });
}

}  // namespace sg
