#include "core/strategy.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace sg {
namespace {
const std::map<std::string, StrategyFn>& Registry() {
  static const auto* registry = new std::map<std::string, StrategyFn>{
      {"full", FullBackprop},
      {"ckpt", CheckpointedBackprop},
      {"seco", ChunkedBackprop},
  };
  return *registry;
}
}  // namespace

std::vector<std::string> StrategyNames() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : Registry()) names.push_back(name);
  return names;
}

absl::StatusOr<StrategyFn> FindStrategy(const std::string& name) {
  auto it = Registry().find(name);
  if (it == Registry().end())
    return absl::InvalidArgumentError(absl::StrCat("--strategy: unknown strategy '", name,
                                                   "' (known: ", absl::StrJoin(StrategyNames(), ", "), ")"));
  return it->second;
}

absl::Status ValidateStrategyOptions(const StrategyOptions& o) {
  if (absl::StatusOr<StrategyFn> fn = FindStrategy(o.name); !fn.ok()) return fn.status();
  if (o.chunk <= 0) return absl::InvalidArgumentError(absl::StrCat("--chunk must be positive, got ", o.chunk));
  if (o.page_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--page_size must be positive, got ", o.page_size));
  if (o.lm_chunk <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--lm_chunk must be positive, got ", o.lm_chunk));
  return absl::OkStatus();
}

std::vector<Chunk> SplitIntoChunks(int64_t seq_len, int64_t chunk) {
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < seq_len; b += chunk) chunks.push_back({b, std::min(seq_len, b + chunk)});
  return chunks;
}

}  // namespace sg
