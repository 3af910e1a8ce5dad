// The transformer family's hyper-parameters (Llama, Qwen2, Qwen3), as read from a Hugging Face config.json or a
// preset, and config.json <-> TransformerConfig.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
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

// Mamba-2's mixer (transformers' Mamba2Mixer; Bamba's, Nemotron-H's, Falcon-H1's): in_proj gives z, the conv's
// input xBC = (x, B, C) and dt per head; a causal depthwise conv and silu over xBC; the SSD scan per head with a
// scalar decay A = -exp(A_log), dt = clamp(softplus(dt + dt_bias), dt_min, dt_max), B and C shared by the heads of a
// group; the D skip; the gated RMSNorm w rmsnorm(y silu(z)) over groups of intermediate / groups; out_proj.
struct Mamba2Config {
  int64_t heads = 0;         // num_heads (mamba_n_heads)
  int64_t head_dim = 0;      // head_dim (mamba_d_head)
  int64_t groups = 1;        // n_groups (mamba_n_groups)
  int64_t state = 0;         // state_size (mamba_d_state, ssm_state_size)
  int64_t conv_kernel = 4;   // conv_kernel (mamba_d_conv)
  int64_t expand = 2;        // heads x head_dim = expand x hidden_size
  int64_t chunk_size = 256;  // transformers' SSD chunk: the same function whatever it is; kept for the config
  bool conv_bias = true;     // use_conv_bias (mamba_conv_bias)
  bool proj_bias = false;    // use_bias (mamba_proj_bias): in_proj's and out_proj's
  double dt_min = 0, dt_max = std::numeric_limits<double>::infinity();  // time_step_limit
  double norm_eps = 1e-5;                                               // the gated norm's epsilon
  bool gated_norm = true;  // Falcon-H1's mamba_rms_norm: false gives y silu(z) to out_proj, without the norm
  int64_t intermediate() const { return heads * head_dim; }
  int64_t conv_dim() const { return intermediate() + 2 * groups * state; }      // x, B, C
  int64_t in_proj_rows() const { return intermediate() + conv_dim() + heads; }  // z, xBC, dt
};

// Falcon-H1's muP multipliers (FalconH1Config's; 1 in every other model): the embedding's output, the logits,
// attention's input, keys and output, Mamba-2's input, in_proj's output groups (z, x, B, C, dt) and output, the MLP's
// gate projection and output.
struct MupMultipliers {
  double embedding = 1, lm_head = 1;
  double attention_in = 1, key = 1, attention_out = 1;
  double ssm_in = 1, ssm_out = 1;
  std::vector<double> ssm = {1, 1, 1, 1, 1};  // ssm_multipliers: z, x, B, C, dt
  double mlp_gate = 1, mlp_down = 1;          // mlp_multipliers
  bool operator==(const MupMultipliers& o) const {
    return embedding == o.embedding && lm_head == o.lm_head && attention_in == o.attention_in && key == o.key &&
           attention_out == o.attention_out && ssm_in == o.ssm_in && ssm_out == o.ssm_out && ssm == o.ssm &&
           mlp_gate == o.mlp_gate && mlp_down == o.mlp_down;
  }
};

// A layer's token mixer and MLP.
enum class Mixer : uint8_t {
  kAttention,
  kDeltaNet,         // Gated DeltaNet (Qwen3-Next, Qwen3.5)
  kMamba2,           // Mamba-2 (Mamba2, Bamba, Nemotron-H)
  kAttentionMamba2,  // attention and Mamba-2 side by side on the same normed input, their outputs summed (Falcon-H1)
  kNone,             // Nemotron-H's MLP layers
};
enum class Mlp : uint8_t {
  kSwiGlu,  // down(silu(gate x) up x), or a sparse MoE block where moe_layers marks
  kRelu2,   // down(relu(up x)^2) (Nemotron-H)
  kNone,    // Mamba2; Nemotron-H's mixer layers
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

  // Hybrids: each layer's token mixer (empty: every layer is full attention) and MLP (empty: SwiGLU everywhere).
  std::vector<Mixer> mixers;
  std::vector<Mlp> mlps;
  LinearAttentionConfig linear;
  Mamba2Config mamba;
  MupMultipliers mup;
  // Attention rotates q and k (RoPE); Nemotron-H's does not.
  bool rope = true;
  // Bamba's embedding is nn.Embedding with padding_idx pad_token_id: the lookup gives that row no gradient. -1: none.
  int64_t pad_token_id = -1;
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
  // (x (1 + w)) and partial RoPE; Gated DeltaNet in the layers mixers marks.
  bool hybrid() const {
    return architecture == "qwen3_next" || architecture == "qwen3_5_text" || architecture == "qwen3_5_moe_text";
  }
  Mixer mixer(int64_t layer) const { return mixers.empty() ? Mixer::kAttention : mixers[layer]; }
  Mlp mlp(int64_t layer) const { return mlps.empty() ? Mlp::kSwiGlu : mlps[layer]; }
  bool is_linear(int64_t layer) const { return mixer(layer) == Mixer::kDeltaNet; }
  bool has_attention(int64_t layer) const {
    return mixer(layer) == Mixer::kAttention || mixer(layer) == Mixer::kAttentionMamba2;
  }
  bool has_mamba(int64_t layer) const {
    return mixer(layer) == Mixer::kMamba2 || mixer(layer) == Mixer::kAttentionMamba2;
  }
  bool is_moe(int64_t layer) const { return !moe_layers.empty() && moe_layers[layer]; }
  // How many layers have each mixer and MLP (counted over the per-layer lists, not num_layers: a config's layer
  // count is checked after these are asked).
  int64_t mixer_count(Mixer m) const {
    return mixers.empty() ? (m == Mixer::kAttention ? num_layers : 0) : std::count(mixers.begin(), mixers.end(), m);
  }
  int64_t mlp_count(Mlp m) const {
    return mlps.empty() ? (m == Mlp::kSwiGlu ? num_layers : 0) : std::count(mlps.begin(), mlps.end(), m);
  }
  int64_t linear_layer_count() const { return mixer_count(Mixer::kDeltaNet); }
  int64_t attention_layer_count() const {
    return mixer_count(Mixer::kAttention) + mixer_count(Mixer::kAttentionMamba2);
  }
  int64_t mamba_layer_count() const { return mixer_count(Mixer::kMamba2) + mixer_count(Mixer::kAttentionMamba2); }
  int64_t moe_layer_count() const { return std::count(moe_layers.begin(), moe_layers.end(), true); }
  // Mamba-2 models and hybrids (mamba2, bamba, nemotron_h, falcon_h1).
  bool mamba_family() const {
    return architecture == "mamba2" || architecture == "bamba" || architecture == "nemotron_h" ||
           architecture == "falcon_h1";
  }
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

class FieldReader;  // core/io/config_fields.h
// Mamba-2 models and hybrids (architecture mamba2, bamba, nemotron_h or falcon_h1): mamba2_config.cc.
// Falcon-H1's config is read and written; its layers are not built yet (CreateTransformer refuses it).
absl::StatusOr<TransformerConfig> ParseMamba2FamilyConfig(const FieldReader& fields, const std::string& source_name,
                                                          const std::string& architecture);
// rope_theta and the RoPE block (rope_parameters or rope_scaling) into config, as ParseTransformerConfig reads them.
absl::Status ParseTransformerRope(const FieldReader& fields, const std::string& source_name, TransformerConfig& config);
std::string Mamba2FamilyConfigToHFJson(const TransformerConfig& config);

// Reads `path`, or `path`/config.json when `path` is a directory.
absl::StatusOr<TransformerConfig> LoadTransformerConfig(const std::string& path);

// A config.json (pretty-printed) that HF transformers loads as the same model,
// with torch_dtype "float32". ParseTransformerConfig reads it back unchanged.
std::string TransformerConfigToHFJson(const TransformerConfig& config);

}  // namespace io
}  // namespace sg
