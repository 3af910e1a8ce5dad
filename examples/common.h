// Flags and helpers shared by the command-line tools (train, bench, gradcheck).
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "core/memory.h"
#include "core/objective.h"
#include "core/strategy.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, strategy);
ABSL_DECLARE_FLAG(int64_t, chunk);
ABSL_DECLARE_FLAG(int64_t, page_size);
ABSL_DECLARE_FLAG(int64_t, lm_chunk);
ABSL_DECLARE_FLAG(int64_t, spaco_budget);
ABSL_DECLARE_FLAG(double, spaco_cap);
ABSL_DECLARE_FLAG(std::string, objective);
ABSL_DECLARE_FLAG(double, dpo_beta);
ABSL_DECLARE_FLAG(double, grpo_clip_eps);
ABSL_DECLARE_FLAG(double, grpo_kl_beta);
ABSL_DECLARE_FLAG(uint64_t, seed);

namespace sg::tools {

// Relative paths resolve against the directory the user ran the command from (bazel run changes the cwd).
std::string ResolveUserPath(const std::string& path);
// A model flag's value as a preset name or a user path; ModelSpec() is --model's.
std::string ModelSpecOf(const std::string& flag_value);
std::string ModelSpec();
absl::StatusOr<DType> ParseDType(const std::string& name);
StrategyOptions StrategyFromFlags();
// --adjoint_window: a positive token count or "none" (no truncation).
absl::StatusOr<int64_t> ParseAdjointWindow(const std::string& text);
ObjectiveOptions ObjectiveFromFlags();
// Writes text to a user path (atomically: temporary file + rename).
absl::Status WriteTextFile(const std::string& path, const std::string& text);
// {"weights": bytes, ...} for a snapshot's per-category peaks, as a JSON object string.
std::string PeakByCategoryJson(const MemorySnapshot& s);
// Exits with the status message (and code 1) when not ok.
void ExitIfError(const absl::Status& s, const char* what);

}  // namespace sg::tools
