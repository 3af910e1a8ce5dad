#include "examples/common.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/presets.h"

ABSL_FLAG(std::string, model, "demo", "preset name (tiny, tiny-qwen2, demo, bench-cpu; Mamba: tiny-ssm, bench-ssm) or a Hugging Face model directory");
ABSL_FLAG(std::string, dtype, "f32", "compute dtype: f32 or f64");
ABSL_FLAG(std::string, strategy, "full", "full | ckpt | seco | spaco | streambp | adjoint (SSMs)");
ABSL_FLAG(int64_t, chunk, 512, "tokens per chunk (seco, spaco) or per partition inside a layer (streambp)");
ABSL_FLAG(int64_t, page_size, 256, "KV-cache page size in tokens");
ABSL_FLAG(int64_t, lm_chunk, 256, "LM-head rows computed at a time");
ABSL_FLAG(int64_t, spaco_budget, 8,
          "spaco: chunks backpropagated per sequence on average (each of k chunks with probability budget/k)");
ABSL_FLAG(double, spaco_cap, 2.0,
          "spaco: cap on the compensation of relayed state gradients (paper: 2); 0 = none, exactly unbiased");
ABSL_FLAG(std::string, adjoint_form, "pairs",
          "adjoint: pairs (adjoint sharding, exact per-layer cotangents) | scan (one reverse scan per chunk, the "
          "cheap exact form) | paper (the paper's multi-layer formula: exact for one layer only)");
ABSL_FLAG(std::string, adjoint_window, "none",
          "adjoint: truncation window T̄ in tokens (only pairs with t - i < T̄), or none");
ABSL_FLAG(std::string, objective, "sft", "sft | dpo | grpo (dpo and grpo read their JSONL formats from --data)");
ABSL_FLAG(double, dpo_beta, 0.1, "dpo: beta");
ABSL_FLAG(double, grpo_clip_eps, 0.2, "grpo: clip epsilon of the ratio");
ABSL_FLAG(double, grpo_kl_beta, 0.04, "grpo: weight of the KL penalty against the reference (0 = none)");
ABSL_FLAG(uint64_t, seed, 1, "random seed (init, data and spaco's sampling)");

namespace sg::tools {

std::string ResolveUserPath(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
  return wd ? absl::StrCat(wd, "/", path) : path;
}

std::string ModelSpecOf(const std::string& m) {
  if (TransformerPreset(m).ok() || MambaPreset(m).ok()) return m;
  return ResolveUserPath(m);
}

std::string ModelSpec() { return ModelSpecOf(absl::GetFlag(FLAGS_model)); }

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "f32") return DType::kF32;
  if (name == "f64") return DType::kF64;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: '", name, "' is not supported (f32, f64)"));
}

StrategyOptions StrategyFromFlags() {
  StrategyOptions o;
  o.name = absl::GetFlag(FLAGS_strategy);
  o.chunk = absl::GetFlag(FLAGS_chunk);
  o.page_size = absl::GetFlag(FLAGS_page_size);
  o.lm_chunk = absl::GetFlag(FLAGS_lm_chunk);
  o.spaco_budget = absl::GetFlag(FLAGS_spaco_budget);
  o.spaco_cap = absl::GetFlag(FLAGS_spaco_cap);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.adjoint_form = absl::GetFlag(FLAGS_adjoint_form);
  absl::StatusOr<int64_t> window = ParseAdjointWindow(absl::GetFlag(FLAGS_adjoint_window));
  ExitIfError(window.status(), "flags");
  o.adjoint_window = *window;
  return o;
}

absl::StatusOr<int64_t> ParseAdjointWindow(const std::string& text) {
  if (text == "none") return StrategyOptions::kNoAdjointWindow;
  int64_t w = 0;
  if (!absl::SimpleAtoi(text, &w) || w <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--adjoint_window must be a positive number of tokens or 'none', got '", text, "'"));
  return w;
}

ObjectiveOptions ObjectiveFromFlags() {
  ObjectiveOptions o;
  o.name = absl::GetFlag(FLAGS_objective);
  o.dpo_beta = absl::GetFlag(FLAGS_dpo_beta);
  o.grpo_clip_eps = absl::GetFlag(FLAGS_grpo_clip_eps);
  o.grpo_kl_beta = absl::GetFlag(FLAGS_grpo_kl_beta);
  return o;
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
    if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(absl::StrCat(path, ": cannot rename"));
  return absl::OkStatus();
}

std::string PeakByCategoryJson(const MemorySnapshot& s) {
  std::string out = "{";
  for (int i = 0; i < kNumMemCategories; ++i)
    absl::StrAppend(&out, i ? ", " : "", "\"", MemCategoryName(static_cast<MemCategory>(i)), "\": ", s.peak[i]);
  return out + "}";
}

void ExitIfError(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "error: %s: %s\n", what, std::string(s.message()).c_str());
  std::exit(1);
}

}  // namespace sg::tools
