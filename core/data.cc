#include "core/data.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace sg {

absl::Status RetrievalTask::Validate() const {
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
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
          absl::StrCat(source, ": token id ", s.ids[i], " at position ", i, " is outside the vocabulary [0, ", vocab, ")"));
    if (s.labels[i] >= vocab || (s.labels[i] < 0 && s.labels[i] != -100))
      return absl::InvalidArgumentError(absl::StrCat(source, ": label ", s.labels[i], " at position ", i,
                                                     " is outside the vocabulary [0, ", vocab, ") and not -100"));
  }
  return absl::OkStatus();
}

namespace {
// Inputs tok[0..n-1), labels shifted by one (the HF causal-LM convention); labels may be given or taken from tok.
Sequence Shifted(const std::vector<int32_t>& tok, const std::vector<int32_t>& labels) {
  Sequence s;
  s.ids.assign(tok.begin(), tok.end() - 1);
  s.labels.assign(labels.begin() + 1, labels.end());
  return s;
}
}  // namespace

absl::StatusOr<std::vector<Sequence>> LoadTokenBin(const std::string& path, int bytes_per_token, int64_t seq_len,
                                                   int64_t vocab) {
  if (bytes_per_token != 2 && bytes_per_token != 4)
    return absl::InvalidArgumentError("--data_dtype must be uint16 or uint32");
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open token file"));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() % bytes_per_token != 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": size ", bytes.size(), " is not a multiple of ",
                                                   bytes_per_token, " bytes per token"));
  const int64_t count = static_cast<int64_t>(bytes.size()) / bytes_per_token;
  if (count < 2) return absl::InvalidArgumentError(absl::StrCat(path, ": fewer than 2 tokens"));
  std::vector<int32_t> tok(count);
  for (int64_t i = 0; i < count; ++i) {
    uint32_t v = 0;
    for (int b = 0; b < bytes_per_token; ++b)
      v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i * bytes_per_token + b])) << (8 * b);
    if (v >= static_cast<uint64_t>(vocab))
      return absl::InvalidArgumentError(absl::StrCat(path, ": token id ", v, " at index ", i,
                                                     " is outside the vocabulary [0, ", vocab, ")"));
    tok[i] = static_cast<int32_t>(v);
  }
  std::vector<Sequence> out;
  for (int64_t b = 0; b + 1 < count; b += seq_len) {
    std::vector<int32_t> window(tok.begin() + b, tok.begin() + std::min(count, b + seq_len + 1));
    out.push_back(Shifted(window, window));
  }
  return out;
}

absl::StatusOr<std::vector<Sequence>> LoadJsonl(const std::string& path, int64_t seq_len, int64_t vocab) {
  if (seq_len <= 0) return absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len));
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open JSONL file"));
  std::vector<Sequence> out;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", lineno);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    auto read_ids = [&](const char* field, std::vector<int32_t>* v) -> absl::Status {
      const auto it = j.find(field);
      if (it == j.end() || !it->is_array())
        return absl::InvalidArgumentError(absl::StrCat(where, ": field '", field, "' missing or not an array"));
      for (const auto& e : *it) {
        if (!e.is_number_integer())
          return absl::InvalidArgumentError(absl::StrCat(where, ": field '", field, "' holds a non-integer"));
        const int64_t x = e.get<int64_t>();
        if (x >= vocab || x < -100)
          return absl::InvalidArgumentError(absl::StrCat(where, ": field '", field, "' holds ", x,
                                                         ", outside the vocabulary [0, ", vocab, ")"));
        v->push_back(static_cast<int32_t>(x));
      }
      return absl::OkStatus();
    };
    std::vector<int32_t> ids, labels;
    if (absl::Status s = read_ids("input_ids", &ids); !s.ok()) return s;
    if (j.contains("labels")) {
      if (absl::Status s = read_ids("labels", &labels); !s.ok()) return s;
      if (labels.size() != ids.size())
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'labels' has ", labels.size(),
                                                       " entries but 'input_ids' has ", ids.size()));
    } else {
      labels = ids;
    }
    if (ids.size() < 2) return absl::InvalidArgumentError(absl::StrCat(where, ": fewer than 2 input_ids"));
    const size_t keep = std::min<size_t>(ids.size(), seq_len + 1);
    ids.resize(keep);
    labels.resize(keep);
    Sequence s = Shifted(ids, labels);
    if (absl::Status st = ValidateSequence(s, vocab, where); !st.ok()) return st;
    out.push_back(std::move(s));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no sequences"));
  return out;
}

}  // namespace sg
