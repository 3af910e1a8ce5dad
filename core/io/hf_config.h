// Hugging Face config.json <-> sg::TransformerConfig for the Llama, Qwen2 and Qwen3
// families.
#pragma once

#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "core/model_config.h"

namespace sg::io {

// Parses the text of a config.json. Errors start with `source_name` and name
// the offending field, e.g.
//   "config.json: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3)".
absl::StatusOr<TransformerConfig> ParseTransformerConfig(const std::string& json_text, const std::string& source_name);

// Reads `path`, or `path`/config.json when `path` is a directory.
absl::StatusOr<TransformerConfig> LoadTransformerConfig(const std::string& path);

// A config.json (pretty-printed) that HF transformers loads as the same model,
// with torch_dtype "float32". ParseTransformerConfig reads it back unchanged.
std::string TransformerConfigToHFJson(const TransformerConfig& config);

// The model family a config.json describes: "transformer" (llama, qwen2, qwen3) or "ssm" (mamba), from model_type or,
// when absent, architectures. Errors name the field.
absl::StatusOr<std::string> ConfigFamily(const std::string& json_text, const std::string& source_name);

// Mamba-1 (model_type "mamba", MambaForCausalLM). time_step_rank "auto" = ceil(hidden_size / 16).
absl::StatusOr<MambaConfig> ParseMambaConfig(const std::string& json_text, const std::string& source_name);
// Reads `path`, or `path`/config.json when `path` is a directory (as LoadTransformerConfig).
absl::StatusOr<MambaConfig> LoadMambaConfig(const std::string& path);
// A config.json that HF transformers loads as the same MambaForCausalLM; ParseMambaConfig reads it back unchanged.
std::string MambaConfigToHFJson(const MambaConfig& config);
// The text of `path`, or of `path`/config.json when `path` is a directory, and the file it came from.
absl::StatusOr<std::pair<std::string, std::string>> ReadConfigJson(const std::string& path);

}  // namespace sg::io
