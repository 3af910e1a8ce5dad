// The transformer family's hyper-parameters (Llama, Qwen2, Qwen3), as read from a Hugging Face config.json or a
// preset, and config.json <-> TransformerConfig.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "core/models/footprint.h"

namespace sg {

// RoPE frequency scaling, as transformers' modeling_rope_utils defines each "rope_type":
//   linear:  inverse frequencies divided by factor;
//   dynamic: NTK-aware: the base grows with the sequence length T once T > max_position_embeddings;
//   yarn:    frequencies blended between divided and kept by a ramp over [beta_slow, beta_fast] rotations of
//            original_max_position_embeddings, and q/k scaled by attention_factor;
//   llama3:  long wavelengths divided by factor, short ones kept, the band between interpolated.
struct RopeScaling {
  std::string type = "default";  // default | linear | dynamic | yarn | llama3
  double factor = 1.0;
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, yarn
  double attention_factor = 0;                   // yarn; 0 = derived from factor (and mscale / mscale_all_dim)
  double mscale = 0, mscale_all_dim = 0;         // yarn (DeepSeek style); 0 = absent
  double beta_fast = 32, beta_slow = 1;          // yarn
  bool truncate = true;                          // yarn: round the ramp's ends outwards
};

// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): per value head a [key_head_dim][value_head_dim] state
// updated by the gated delta rule, fed by a causal depthwise conv over q, k and v.
struct LinearAttentionConfig {
  int64_t conv_kernel = 4;     // linear_conv_kernel_dim
  int64_t key_head_dim = 0;    // linear_key_head_dim
  int64_t value_head_dim = 0;  // linear_value_head_dim
  int64_t key_heads = 0;       // linear_num_key_heads
  int64_t value_heads = 0;     // linear_num_value_heads (a multiple of key_heads)
  int64_t key_dim() const { return key_heads * key_head_dim; }
  int64_t value_dim() const { return value_heads * value_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // the conv's channels: q, k, v
};

// A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen3-Next, Qwen3.5-MoE): a router picks top_k of `experts`
// SwiGLU experts per token, weighted by their softmax probabilities (renormalised over the k when `normalize`);
// Qwen3-Next and Qwen3.5-MoE add a shared SwiGLU expert scaled by a sigmoid gate.
struct MoeConfig {
  int64_t experts = 0;              // num_experts (Mixtral: num_local_experts)
  int64_t top_k = 0;                // num_experts_per_tok
  int64_t intermediate = 0;         // moe_intermediate_size (Mixtral: intermediate_size)
  bool normalize = true;            // norm_topk_prob (always, on Mixtral and Qwen3.5-MoE)
  int64_t shared_intermediate = 0;  // shared_expert_intermediate_size; 0: no shared expert
  bool aux_loss = false;            // output_router_logits: the load-balancing loss joins the training loss
  double aux_loss_coef = 0.001;     // router_aux_loss_coef
};

// Transformer of the Llama / Qwen2 / Qwen3 family, and the Qwen3-Next / Qwen3.5 hybrids.
struct TransformerConfig {
  // HF model_type: "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text" or
  // "qwen3_5_moe_text" (Qwen3.5's text models; also read from a "qwen3_5" / "qwen3_5_moe" config's text_config,
  // `conditional`).
  std::string architecture = "llama";
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
  bool attention_bias = false;  // q/k/v biases, and o_proj's on Llama and Qwen3 (Qwen2: q/k/v always, no o)
  bool mlp_bias = false;        // gate/up/down biases (Llama)
  int64_t max_position_embeddings = 0;

  // Hybrids: per layer, true where it is Gated DeltaNet linear attention (layer_types "linear_attention"); empty:
  // every layer is full attention.
  std::vector<bool> linear_layers;
  LinearAttentionConfig linear;
  double partial_rotary_factor = 1.0;  // RoPE rotates the first head_dim x this dims of each head
  // Qwen3.5 as published (Qwen3_5ForConditionalGeneration): the text model under "model.language_model.", beside a
  // vision tower the engine does not run (kept on save).
  bool conditional = false;
  // Mixtures of experts: per layer, true where its MLP is a sparse MoE block; empty: dense MLPs everywhere.
  std::vector<bool> moe_layers;
  MoeConfig moe;

  // Qwen3: RMSNorm over head_dim of each q and k head (q_norm / k_norm), before RoPE.
  bool qk_norm() const { return architecture == "qwen3" || architecture == "qwen3_moe" || hybrid(); }
  // Qwen3-Next / Qwen3.5: gated attention (q_proj gives each head's query and output gate), zero-centred RMSNorms
  // (x (1 + w)) and partial RoPE; Gated DeltaNet in the layers linear_layers marks.
  bool hybrid() const {
    return architecture == "qwen3_next" || architecture == "qwen3_5_text" || architecture == "qwen3_5_moe_text";
  }
  bool is_linear(int64_t layer) const { return !linear_layers.empty() && linear_layers[layer]; }
  bool is_moe(int64_t layer) const { return !moe_layers.empty() && moe_layers[layer]; }
  // How many layers are Gated DeltaNet / MoE (counted over the per-layer lists, not num_layers: a config's layer
  // count is checked after these are asked).
  int64_t linear_layer_count() const { return std::count(linear_layers.begin(), linear_layers.end(), true); }
  int64_t moe_layer_count() const { return std::count(moe_layers.begin(), moe_layers.end(), true); }
  int64_t rotary_dim() const;  // head_dim x partial_rotary_factor, as transformers truncates it
  // Where the text model's parameters live: "model." or, in the conditional layout, "model.language_model.".
  std::string prefix() const { return conditional ? "model.language_model." : "model."; }
  // Whether o_proj has a bias: attention_bias means q/k/v/o on Llama and Qwen3, q/k/v only on Qwen2.
  bool o_bias() const { return attention_bias && architecture != "qwen2"; }
};

// Dynamic NTK's RoPE base for a sequence of `tokens` (transformers' len(input_ids)): rope_theta (1 + factor (T - M) /
// M) ^ (d / (d - 2)) with T = max(tokens, M), M = max_position_embeddings, d = head_dim; transformers writes the
// bracket factor T / M - (factor - 1), equal but inexact at T = M for a large factor. rope_theta itself for T <= M.
double DynamicRopeBase(const TransformerConfig& c, int64_t tokens);

// The parameters and bytes a model of c takes (core/models/footprint.h).
absl::StatusOr<ModelFootprint> Footprint(const TransformerConfig& c, DType dtype);

namespace io {

// Parses the text of a config.json. Errors start with `source_name` and name
// the offending field, e.g.
//   "config.json: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3)".
absl::StatusOr<TransformerConfig> ParseTransformerConfig(const std::string& json_text, const std::string& source_name);

// Reads `path`, or `path`/config.json when `path` is a directory.
absl::StatusOr<TransformerConfig> LoadTransformerConfig(const std::string& path);

// A config.json (pretty-printed) that HF transformers loads as the same model,
// with torch_dtype "float32". ParseTransformerConfig reads it back unchanged.
std::string TransformerConfigToHFJson(const TransformerConfig& config);

}  // namespace io
}  // namespace sg
