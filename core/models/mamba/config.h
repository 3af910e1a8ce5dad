// The Mamba-1 family's hyper-parameters (HF MambaForCausalLM), as read from a Hugging Face config.json or a preset,
// and config.json <-> MambaConfig.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "core/models/footprint.h"

namespace sg {

// Mamba-1 state-space model (HF MambaForCausalLM, model_type "mamba").
struct MambaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // d_model
  int64_t state_size = 16;        // N, the scan state per channel
  int64_t num_layers = 0;         // num_hidden_layers
  int64_t intermediate_size = 0;  // d_inner = expand * hidden_size
  int64_t conv_kernel = 4;
  int64_t time_step_rank = 0;  // dt_rank; "auto" = ceil(hidden_size / 16)
  bool use_bias = false;       // in_proj / out_proj biases
  bool use_conv_bias = true;
  double layer_norm_epsilon = 1e-5;
  bool tie_word_embeddings = true;
};

// The parameters and bytes a model of c takes (core/models/footprint.h).
absl::StatusOr<ModelFootprint> Footprint(const MambaConfig& c, DType dtype);

namespace io {

// Mamba-1 (model_type "mamba", MambaForCausalLM). time_step_rank "auto" = ceil(hidden_size / 16).
absl::StatusOr<MambaConfig> ParseMambaConfig(const std::string& json_text, const std::string& source_name);
// Reads `path`, or `path`/config.json when `path` is a directory (as LoadTransformerConfig).
absl::StatusOr<MambaConfig> LoadMambaConfig(const std::string& path);
// A config.json that HF transformers loads as the same MambaForCausalLM; ParseMambaConfig reads it back unchanged.
std::string MambaConfigToHFJson(const MambaConfig& config);

}  // namespace io
}  // namespace sg
