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
  const int64_t filler = vocab - kFirstKey - num_pairs - num_values;
  if (filler < 1)
    return absl::InvalidArgumentError(absl::StrCat("retrieval task: vocab ", vocab, " too small for ", num_pairs,
                                                   " keys and ", num_values, " values"));
  if (seq_len < 6 * num_pairs + 2)
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval task: --seq_len ", seq_len, " too short for ", num_pairs, " key-value pairs (need >= ",
                     6 * num_pairs + 2, ")"));
  return absl::OkStatus();
}

Sequence RetrievalTask::Make(uint64_t seed, int64_t index, std::vector<int64_t>* distances) const {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index));
  const int32_t first_value = static_cast<int32_t>(vocab - num_values);
  const int32_t first_filler = static_cast<int32_t>(kFirstKey + num_pairs);
  std::uniform_int_distribution<int32_t> filler(first_filler, first_value - 1);
  std::uniform_int_distribution<int32_t> value(first_value, static_cast<int32_t>(vocab - 1));

  // T + 1 tokens: inputs are [0, T), labels are the next tokens.
  const int64_t total = seq_len + 1;
  std::vector<int32_t> tok(total);
  for (int32_t& t : tok) t = filler(rng);
  const int64_t query_start = total - 3 * num_pairs;

  // Non-overlapping slots of 3 tokens in [0, query_start), chosen uniformly.
  const int64_t slots = query_start / 3;
  std::vector<int64_t> slot(slots);
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), rng);
  std::vector<int64_t> key_pos(num_pairs);
  std::vector<int32_t> key_value(num_pairs);
  for (int64_t k = 0; k < num_pairs; ++k) {
    const int64_t p = slot[k] * 3;
    key_pos[k] = p + 1;
    key_value[k] = value(rng);
    tok[p] = kPairMark;
    tok[p + 1] = static_cast<int32_t>(kFirstKey + k);
    tok[p + 2] = key_value[k];
  }
  std::vector<int64_t> order(num_pairs);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);

  Sequence s;
  s.labels.assign(seq_len, -100);
  if (distances) distances->clear();
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t k = order[i], p = query_start + 3 * i;
    tok[p] = kQueryMark;
    tok[p + 1] = static_cast<int32_t>(kFirstKey + k);
    tok[p + 2] = key_value[k];
    s.labels[p + 1] = key_value[k];  // at the query's key, predict the value
    if (distances) distances->push_back(p + 1 - key_pos[k]);
  }
  s.ids.assign(tok.begin(), tok.end() - 1);
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
