// Hugging Face PEFT's LoRA adapter files: adapter_config.json (a LoraConfig) and adapter_model.safetensors, whose
// tensors are named "base_model.model.<module>.lora_A.weight" ([r][in]) and "....lora_B.weight" ([out][r]). The
// model-level save/load is core/lora_io.h; this is the format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace sg::io {

inline constexpr char kPeftConfigFile[] = "adapter_config.json";
inline constexpr char kPeftWeightsFile[] = "adapter_model.safetensors";
// PeftModel wraps the base model as base_model.model: saved tensor names carry this prefix.
inline constexpr char kPeftTensorPrefix[] = "base_model.model.";

struct PeftLoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0;
  // Module names, or module paths whose last component names the module (PEFT writes either, in any order);
  // empty when all_linear.
  std::vector<std::string> target_modules;
  bool all_linear = false;  // target_modules was "all-linear" (PEFT's shorthand, any case)
  // Parameters adapted directly (PEFT's lora.ParamWrapper, e.g. "mlp.experts.gate_up_proj"): names or paths ending
  // in them; target_modules may then be empty.
  std::vector<std::string> target_parameters;
  std::string base_model_name_or_path;
  std::string task_type = "CAUSAL_LM";
};

// Parses the text of an adapter_config.json (PEFT 0.21's LoraConfig). Errors start with `source_name` and name the
// field. What the engine cannot reproduce is refused, naming the field: peft_type other than LORA, bias other than
// "none", init_lora_weights other than true, false or "gaussian" (PiSSA, OLoRA, CorDA, LoftQ, ... change or need
// the base weights, which the adapter file does not carry), any other LoRA variant switched on (use_dora,
// use_rslora, lora_bias, fan_in_fan_out, use_qalora, rank/alpha patterns, layer selection or replication,
// modules_to_save, ...), and target_modules given as a regular expression rather than a list or "all-linear".
absl::StatusOr<PeftLoraConfig> ParsePeftLoraConfig(const std::string& json_text, const std::string& source_name);

// Reads and parses `path` (an adapter_config.json); errors name the path.
absl::StatusOr<PeftLoraConfig> ReadPeftLoraConfig(const std::string& path);

// The adapter_config.json PEFT writes for such a LoraConfig (peft_type "LORA", bias "none", fan_in_fan_out
// false, inference_mode true, ...); ParsePeftLoraConfig reads it back unchanged.
std::string PeftLoraConfigToJson(const PeftLoraConfig& config);

}  // namespace sg::io
