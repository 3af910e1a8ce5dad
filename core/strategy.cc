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
      {"spaco", SparseChunkedBackprop},
      {"streambp", StreamBackprop},
      {"adjoint", AdjointBackprop},
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
  if (o.sparse_pages < 0)
    return absl::InvalidArgumentError(absl::StrCat("--sparse_pages must be 0 (dense) or positive, got ", o.sparse_pages));
  if (o.sparse_pages > 0 && o.name != "seco" && o.name != "full")
    return absl::InvalidArgumentError(absl::StrCat(
        "--sparse_pages is implemented for --strategy=seco (and full, whose single chunk attends densely), not '",
        o.name, "'"));
  if (o.attention_group < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--attention_group must be 0 (the default) or a positive number of tokens, got ", o.attention_group));
  if (o.offload && o.name != "seco")
    return absl::InvalidArgumentError(
        absl::StrCat("--offload is implemented for --strategy=seco (the chunked schedule it prefetches for), not '",
                     o.name, "'"));
  if (o.name == "spaco") {
    if (o.spaco_budget <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat("--spaco_budget must be at least 1 chunk, got ", o.spaco_budget));
    if (!(o.spaco_cap == 0 || o.spaco_cap >= 1))  // also rejects NaN
      return absl::InvalidArgumentError(
          absl::StrCat("--spaco_cap must be 0 (no cap) or at least 1, got ", o.spaco_cap));
  }
  if (o.name == "adjoint") {
    if (o.adjoint_form != "pairs" && o.adjoint_form != "scan" && o.adjoint_form != "paper")
      return absl::InvalidArgumentError(
          absl::StrCat("--adjoint_form: unknown form '", o.adjoint_form, "' (known: pairs, scan, paper)"));
    if (o.adjoint_window <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat("--adjoint_window must be a positive number of tokens, got ", o.adjoint_window));
    if (o.adjoint_form == "scan" && o.adjoint_window != StrategyOptions::kNoAdjointWindow)
      return absl::InvalidArgumentError(
          "--adjoint_window truncates the (t, i) pairs of --adjoint_form=pairs or paper; the reverse scan of "
          "--adjoint_form=scan is exact and has no window");
  }
  return absl::OkStatus();
}

absl::Status ValidateStrategyForModel(const StrategyOptions& o, const Model& m) {
  if (o.name == "adjoint" && m.scan_layers() == Model::ScanLayers::kNone)
    return absl::InvalidArgumentError(
        absl::StrCat("--strategy=adjoint needs a state-space model (Mamba or Mamba-2 layers, e.g. --model=tiny-ssm or "
                     "tiny-mamba2); this model (family '",
                     m.family(), "') has none"));
  if (o.name == "adjoint" && o.adjoint_form == "paper" && m.scan_layers() != Model::ScanLayers::kAll)
    return absl::InvalidArgumentError(
        "--adjoint_form=paper is the paper's formula for a stack of scan layers only; this model also has attention "
        "or MLP layers (use --adjoint_form=pairs or scan)");
  if (o.offload && m.family() != "transformer")
    return absl::InvalidArgumentError(absl::StrCat("--offload moves KV-cache pages to host memory and needs a "
                                                   "transformer; this model's family is '",
                                                   m.family(), "'"));
  if (o.offload_experts) return m.CheckExpertOffload();
  return absl::OkStatus();
}

absl::Status ValidateSpacoBudget(const StrategyOptions& o, int64_t seq_len, const std::string& what) {
  if (o.name != "spaco") return absl::OkStatus();
  const int64_t k = (seq_len + o.chunk - 1) / o.chunk;
  if (o.spaco_budget > k)
    return absl::InvalidArgumentError(absl::StrCat("--spaco_budget=", o.spaco_budget, " exceeds the ", k,
                                                   " chunks of ", what, " (", seq_len, " tokens, --chunk=", o.chunk,
                                                   "): use a budget of at most ", k, " or a smaller chunk"));
  return absl::OkStatus();
}

// splitmix-style mixing: a distinct, reproducible seed per (user seed, call, sequence).
uint64_t SequenceSeed(uint64_t seed, uint64_t call, uint64_t index) {
  uint64_t h = seed ^ 0x243F6A8885A308D3ull;
  for (uint64_t v : {call, index}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
  }
  return h;
}

absl::Status CatchStrategyErrors(const std::string& what, const std::function<void()>& f) {
  try {
    f();
  } catch (const Cancelled&) {
    return absl::CancelledError(absl::StrCat(what, " cancelled"));
  } catch (...) {  // out of memory: RESOURCE_EXHAUSTED with the bytes asked and available
    return StatusOfCurrentException(what);
  }
  return absl::OkStatus();
}

std::vector<Chunk> SplitIntoChunks(int64_t seq_len, int64_t chunk) {
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < seq_len; b += chunk) chunks.push_back({b, std::min(seq_len, b + chunk)});
  return chunks;
}

}  // namespace sg
