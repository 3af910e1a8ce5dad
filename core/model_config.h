// Model hyper-parameters, as read from a Hugging Face config.json or a built-in preset.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace sg {

// Llama-3 style RoPE frequency scaling ("rope_scaling": {"rope_type": "llama3", ...}).
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// Transformer of the Llama / Qwen2 family.
struct TransformerConfig {
  std::string architecture = "llama";  // "llama" or "qwen2" (HF model_type)
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // d_model
  int64_t num_layers = 0;         // num_hidden_layers
  int64_t num_heads = 0;          // num_attention_heads
  int64_t num_kv_heads = 0;       // num_key_value_heads (defaults to num_heads)
  int64_t head_dim = 0;           // hidden_size / num_heads unless given
  int64_t intermediate_size = 0;  // SwiGLU width
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;    // q/k/v biases (Qwen2: always true)
  int64_t max_position_embeddings = 0;
};

// Mamba-1 state-space model (HF MambaForCausalLM, model_type "mamba").
struct MambaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // d_model
  int64_t state_size = 16;        // N, the scan state per channel
  int64_t num_layers = 0;         // num_hidden_layers
  int64_t intermediate_size = 0;  // d_inner = expand * hidden_size
  int64_t conv_kernel = 4;
  int64_t time_step_rank = 0;     // dt_rank; "auto" = ceil(hidden_size / 16)
  bool use_bias = false;          // in_proj / out_proj biases
  bool use_conv_bias = true;
  double layer_norm_epsilon = 1e-5;
  bool tie_word_embeddings = true;
};

// What a model of this configuration takes once created: its parameters, and the host or device bytes of
// their values and gradients (two copies, each tensor rounded to the allocator's 64 bytes, plus bookkeeping per
// tensor). Every product and sum is overflow-checked: an overflow, or a field past what the engine represents
// (token ids and page indices are int32, layer indices int), is an error naming the config field.
struct ModelFootprint {
  int64_t parameters = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;
};
absl::StatusOr<ModelFootprint> Footprint(const TransformerConfig& c, DType dtype);
absl::StatusOr<ModelFootprint> Footprint(const MambaConfig& c, DType dtype);

// RESOURCE_EXHAUSTED, naming the bytes needed and available, when a model of footprint f does not fit in what
// `available` bytes (< 0: unknown, always fits) allow. `what` names the model (its config file or preset).
absl::Status CheckFootprintFits(const ModelFootprint& f, int64_t available, const std::string& what);

}  // namespace sg
