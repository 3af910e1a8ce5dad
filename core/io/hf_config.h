// Hugging Face config.json <-> sg::TransformerConfig for the Llama, Qwen2 and Qwen3
// families.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// What a config.json says its model is: model_type (absent in some exports) and the architectures' names, from which
// the registry picks the family that reads it (core/models/family.h). Errors name the field.
struct ConfigModelType {
  std::optional<std::string> model_type;
  std::vector<std::string> architectures;
};
absl::StatusOr<ConfigModelType> ReadConfigModelType(const std::string& json_text, const std::string& source_name);

// Mamba-1 (model_type "mamba", MambaForCausalLM). time_step_rank "auto" = ceil(hidden_size / 16).
absl::StatusOr<MambaConfig> ParseMambaConfig(const std::string& json_text, const std::string& source_name);
// Reads `path`, or `path`/config.json when `path` is a directory (as LoadTransformerConfig).
absl::StatusOr<MambaConfig> LoadMambaConfig(const std::string& path);
// A config.json that HF transformers loads as the same MambaForCausalLM; ParseMambaConfig reads it back unchanged.
std::string MambaConfigToHFJson(const MambaConfig& config);
// The text of `path`, or of `path`/config.json when `path` is a directory, and the file it came from.
absl::StatusOr<std::pair<std::string, std::string>> ReadConfigJson(const std::string& path);

}  // namespace sg::io
