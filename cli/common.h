// Flags and helpers shared by the command-line tools (train, bench, gradcheck).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "base/memory.h"
#include "cli/trainer_flags.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/strategy.h"

ABSL_DECLARE_FLAG(int32_t, threads);
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int64_t, max_line_bytes);
ABSL_DECLARE_FLAG(std::string, overlong);
ABSL_DECLARE_FLAG(int64_t, doc_sep_token);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, matmul);
ABSL_DECLARE_FLAG(int64_t, lora_rank);
ABSL_DECLARE_FLAG(double, lora_alpha);
ABSL_DECLARE_FLAG(double, lora_dropout);
ABSL_DECLARE_FLAG(std::string, lora_targets);
ABSL_DECLARE_FLAG(std::string, lora_init);

namespace sg::tools {

// The start of every tool's main: re-executes itself once with OMP_WAIT_POLICY=PASSIVE when the user did not set
// it; sets the usage text; --help prints every flag of the tool and exits 0; parses the flags; applies --threads.
void InitTool(int argc, char** argv, const char* usage);

// Relative paths resolve against the directory the user ran the command from (bazel run changes the cwd).
std::string ResolveUserPath(const std::string& path);
// A model flag's value as a preset name or a user path; ModelSpec() is --model's.
std::string ModelSpecOf(const std::string& flag_value);
std::string ModelSpec();
absl::StatusOr<DType> ParseDType(const std::string& name);
StrategyOptions StrategyFromFlags();
// --device and --matmul: the device models go on, with its matmul mode set. Exits naming the flag when the device
// cannot run here (no GPU, a build without --config=cuda) or refuses the mode.
Device DeviceFromFlags();
// Refuses, before any step, a run whose plan (core/plan.h: a step at seq_len walked on a meta twin of the model,
// optimizer moments included) does not fit in the device's free memory (the host's for the CPU, offloaded pages
// included), naming the numbers per category; seq_len 0 plans nothing. Then caps the model's tracker at the free
// memory, so that a later overflow is RESOURCE_EXHAUSTED before the device runs out.
absl::Status CheckDeviceMemory(Model& model, const StrategyOptions& s, int64_t seq_len);
// --adjoint_window: a positive token count or "none" (no truncation).
absl::StatusOr<int64_t> ParseAdjointWindow(const std::string& text);
ObjectiveOptions ObjectiveFromFlags();
// Writes text to a user path (atomically: temporary file + rename).
absl::Status WriteTextFile(const std::string& path, const std::string& text);
// {"weights": bytes, ...} for a snapshot's per-category peaks, as a JSON object string.
std::string PeakByCategoryJson(const MemorySnapshot& s);
// LoRA from --lora_rank, --lora_alpha, --lora_dropout, --lora_targets and --lora_init on a freshly loaded model
// (core/lora.h): nothing when neither --lora_rank nor --lora_init is given. --lora_init loads a PEFT adapter
// directory (its rank, alpha and targets; flags given as well must agree, --lora_dropout overrides). Exits naming
// the flag on error. Returns a one-line description ("" when LoRA is off).
std::string ApplyLoraFlags(Model& model);
// Whether --lora_rank or --lora_init asks for LoRA: the model is then created with a frozen base (LoadAnyModel's
// frozen_base), so that no gradient of the base is ever allocated.
bool LoraRequested();
// The trained model into `dir`: HF config.json + model.safetensors; with LoRA on, the PEFT adapter files
// (adapter_config.json + adapter_model.safetensors, base_model_name_or_path = base) unless merge, which writes the
// merged weights as a plain HF model instead; the model's weights in save_dtype (core/model_io.h's SaveDType).
absl::Status SaveTrained(Model& model, const std::string& dir, const std::string& base, bool merge,
                         std::optional<DType> save_dtype = std::nullopt);
// What SaveTrained(model, dir, base, merge) will need, checked before training (core/model_io.h's CheckModelSave,
// or for LoRA adapters a directory that can be written).
absl::Status CheckSaveTrained(Model& model, const std::string& dir, const std::string& base, bool merge);
// After a save at the end of a run failed: writes with write(dir) into a new directory beside `target`, else under
// $TMPDIR (or /tmp), so that a finished run is never thrown away. Returns that directory.
absl::StatusOr<std::string> KeepElsewhere(const std::string& target,
                                          const std::function<absl::Status(const std::string& dir)>& write);
// {"rank", "alpha", "dropout", "targets", "adapters", "trainable_params"} of the model's LoRA, or null.
std::string LoraJson(Model& model);

// Exits with the status message (and code 1) when not ok.
void ExitIfError(const absl::Status& s, const char* what);
// A tool's main: runs body; an exception escaping it (out of memory, I/O, anything else) becomes one error line with
// its status (RESOURCE_EXHAUSTED with the bytes asked and available, the errno's code, INTERNAL naming the tool) and
// exit code 1, never an abort.
int RunTool(const char* tool, int (*body)());

}  // namespace sg::tools
