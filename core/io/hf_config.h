// Hugging Face config.json <-> sg::TransformerConfig for the Llama and Qwen2
// families.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "core/model_config.h"

namespace sg::io {

// Parses the text of a config.json. Errors start with `source_name` and name
// the offending field, e.g.
//   "config.json: model_type 'gpt2' is not supported (supported: llama, qwen2)".
absl::StatusOr<TransformerConfig> ParseTransformerConfig(const std::string& json_text,
                                                         const std::string& source_name);

// Reads `path`, or `path`/config.json when `path` is a directory.
absl::StatusOr<TransformerConfig> LoadTransformerConfig(const std::string& path);

// A config.json (pretty-printed) that HF transformers loads as the same model,
// with torch_dtype "float32". ParseTransformerConfig reads it back unchanged.
std::string TransformerConfigToHFJson(const TransformerConfig& config);

}  // namespace sg::io
