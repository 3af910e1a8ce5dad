// The transformer presets: small models for tests and demos, and real models' shapes.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/models/transformer/transformer.h"

namespace sg {
namespace {

TransformerConfig Llama(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn) {
  TransformerConfig c;
  c.architecture = "llama";
  c.vocab_size = vocab;
  c.hidden_size = d;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = d / heads;
  c.intermediate_size = ffn;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 131072;
  return c;
}

// Qwen2.5's shared layout: attention biases, rope_theta 1e6, untied head, vocabulary 152064.
TransformerConfig Qwen25(int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn, double eps) {
  TransformerConfig c = Llama(152064, d, layers, heads, kv_heads, ffn);
  c.architecture = "qwen2";
  c.attention_bias = true;
  c.rope_theta = 1000000.0;
  c.rms_norm_eps = eps;
  return c;
}

// Qwen3.5's text model (qwen3_5_text): three Gated DeltaNet layers to one gated attention layer, head_dim 256 with
// a quarter of it rotated, linear key and value heads of 128 dims, conv kernel 4, rope_theta 1e7, 262144 positions.
TransformerConfig Qwen35(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t ffn, int64_t key_heads, int64_t value_heads, int64_t linear_head_dim) {
  TransformerConfig c = Llama(vocab, d, layers, heads, kv_heads, ffn);
  c.architecture = "qwen3_5_text";
  c.head_dim = head_dim;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000000.0;
  c.max_position_embeddings = 262144;
  c.partial_rotary_factor = 0.25;
  for (int64_t i = 0; i < layers; ++i) c.mixers.push_back((i + 1) % 4 != 0 ? Mixer::kDeltaNet : Mixer::kAttention);
  c.linear = {4, linear_head_dim, linear_head_dim, key_heads, value_heads};
  return c;
}

// A sparse MoE block in the layers `moe` marks: `experts` SwiGLU experts of width `width`, top_k a token.
void WithExperts(TransformerConfig& c, std::vector<bool> moe, int64_t experts, int64_t top_k, int64_t width,
                 bool normalize, int64_t shared = 0) {
  c.moe_layers = std::move(moe);
  c.moe.experts = experts;
  c.moe.top_k = top_k;
  c.moe.intermediate = width;
  c.moe.normalize = normalize;
  c.moe.shared_intermediate = shared;
}

// Mamba2ForCausalLM: `layers` Mamba-2 mixers of `heads` heads of head_dim (heads x head_dim = 2 d), state N, conv
// kernel 4, no MLP.
TransformerConfig Mamba2(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t head_dim, int64_t groups,
                         int64_t N) {
  TransformerConfig c;
  c.architecture = "mamba2";
  c.vocab_size = vocab;
  c.hidden_size = d;
  c.num_layers = layers;
  c.rms_norm_eps = 1e-5;
  c.mamba.heads = heads;
  c.mamba.head_dim = head_dim;
  c.mamba.groups = groups;
  c.mamba.state = N;
  c.mamba.expand = heads * head_dim / d;
  c.mixers.assign(layers, Mixer::kMamba2);
  c.mlps.assign(layers, Mlp::kNone);
  return c;
}

// BambaForCausalLM: Llama's attention (RoPE on half of each head) in the layers `attention` lists, Mamba-2 (heads
// of 2 d / heads dims, one group, state N) in the others, a SwiGLU MLP in every layer.
TransformerConfig Bamba(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                        int64_t mamba_heads, int64_t N, const std::vector<int64_t>& attention) {
  TransformerConfig c = Llama(vocab, d, layers, heads, kv_heads, ffn);
  c.architecture = "bamba";
  c.max_position_embeddings = 262144;
  c.partial_rotary_factor = 0.5;
  c.mamba = Mamba2(vocab, d, layers, mamba_heads, 2 * d / mamba_heads, 1, N).mamba;
  c.mixers.assign(layers, Mixer::kMamba2);
  for (int64_t l : attention) c.mixers[l] = Mixer::kAttention;
  return c;
}

// NemotronHForCausalLM: a layer per letter of `pattern` (M Mamba-2, * attention without RoPE, - ReLU² MLP).
TransformerConfig NemotronH(int64_t vocab, int64_t d, const std::string& pattern, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t ffn, int64_t mamba_heads, int64_t mamba_head_dim, int64_t groups,
                            int64_t N) {
  const int64_t layers = static_cast<int64_t>(pattern.size());
  TransformerConfig c = Llama(vocab, d, layers, heads, kv_heads, ffn);
  c.architecture = "nemotron_h";
  c.rope = false;
  c.head_dim = head_dim;
  c.max_position_embeddings = 4096;
  c.mamba = Mamba2(vocab, d, layers, mamba_heads, mamba_head_dim, groups, N).mamba;
  c.mamba.chunk_size = 128;
  c.mamba.dt_min = 0.001;  // time_step_min
  c.mixers.clear();
  for (char k : pattern) {
    c.mixers.push_back(k == 'M' ? Mixer::kMamba2 : k == '*' ? Mixer::kAttention : Mixer::kNone);
    c.mlps.push_back(k == '-' ? Mlp::kRelu2 : Mlp::kNone);
  }
  return c;
}

// FalconH1ForCausalLM: in every layer attention (RoPE) beside Mamba-2 (`mamba_heads` heads of `mamba_head_dim`, one
// group, state N, the gated norm), then a SwiGLU MLP.
TransformerConfig FalconH1(int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t ffn, int64_t mamba_heads, int64_t mamba_head_dim, int64_t N) {
  TransformerConfig c = Llama(vocab, d, layers, heads, kv_heads, ffn);
  c.architecture = "falcon_h1";
  c.head_dim = head_dim;
  c.rms_norm_eps = 1e-5;
  c.mamba = Mamba2(vocab, d, layers, mamba_heads, mamba_head_dim, 1, N).mamba;
  c.mamba.expand = 2;
  c.mixers.assign(layers, Mixer::kAttentionMamba2);
  c.pad_token_id = 0;
  return c;
}

}  // namespace

std::vector<std::string> TransformerPresetNames() {
  return {"tiny",
          "tiny-qwen2",
          "tiny-qwen3.5",
          "tiny-qwen3-moe",
          "tiny-qwen3-next",
          "tiny-mamba2",
          "tiny-bamba",
          "tiny-nemotron-h",
          "tiny-falcon-h1",
          "demo",
          "bench-cpu",
          "bench-cpu-qwen3.5",
          "llama-1b-shape",
          "qwen2.5-7b-shape",
          "qwen3-8b-shape",
          "qwen3.5-9b-shape",
          "qwen3.5-27b-shape",
          "qwen3-30b-a3b-shape",
          "qwen3.5-35b-a3b-shape",
          "mixtral-8x7b-shape",
          "mamba2-2.7b-shape",
          "bamba-9b-shape",
          "nemotron-h-8b-shape",
          "falcon-h1-7b-shape",
          "llama-3.1-8b",
          "qwen2.5-7b",
          "qwen2.5-32b"};
}

absl::StatusOr<TransformerConfig> TransformerPreset(const std::string& name) {
  if (name == "tiny") return Llama(97, 32, 3, 4, 2, 48);
  if (name == "tiny-qwen2") {
    TransformerConfig c = Llama(97, 32, 2, 4, 1, 40);
    c.architecture = "qwen2";
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
    return c;
  }
  // A hybrid for tests: Gated DeltaNet and attention layers alternating (two of each), head_dim 16 with 4 dims
  // rotated, 4 value heads on 2 key heads.
  if (name == "tiny-qwen3.5") {
    TransformerConfig c = Qwen35(97, 32, 4, 4, 2, 16, 48, 2, 4, 8);
    c.mixers = {Mixer::kDeltaNet, Mixer::kAttention, Mixer::kDeltaNet, Mixer::kAttention};
    c.max_position_embeddings = 4096;
    return c;
  }
  // Mixtures of experts for tests: a Qwen3-MoE (q/k norms) whose middle layer is dense, 4 experts of which 2 a
  // token; a Qwen3-Next hybrid with experts and a shared expert in every layer.
  if (name == "tiny-qwen3-moe") {
    TransformerConfig c = Llama(97, 32, 3, 4, 2, 48);
    c.architecture = "qwen3_moe";
    c.rms_norm_eps = 1e-6;
    WithExperts(c, {true, false, true}, 4, 2, 16, /*normalize=*/false);
    return c;
  }
  if (name == "tiny-qwen3-next") {
    TransformerConfig c = Qwen35(97, 32, 4, 4, 2, 16, 48, 2, 4, 8);
    c.architecture = "qwen3_next";
    c.mixers = {Mixer::kDeltaNet, Mixer::kAttention, Mixer::kDeltaNet, Mixer::kAttention};
    c.max_position_embeddings = 4096;
    WithExperts(c, {true, true, true, true}, 4, 2, 16, /*normalize=*/true, /*shared=*/16);
    return c;
  }
  // Mamba-2 for tests: 3 layers, 8 heads of 8 in 2 groups, state 16, tied embeddings.
  if (name == "tiny-mamba2") {
    TransformerConfig c = Mamba2(97, 32, 3, 8, 8, 2, 16);
    c.mamba.chunk_size = 16;
    c.tie_word_embeddings = true;
    return c;
  }
  // Bamba for tests: Mamba-2, attention, Mamba-2 (8 heads of 8, state 16; 4 attention heads on 2 KV heads).
  if (name == "tiny-bamba") {
    TransformerConfig c = Bamba(97, 32, 3, 4, 2, 48, 8, 16, {1});
    c.mamba.chunk_size = 16;
    return c;
  }
  // Falcon-H1 for tests: 2 layers of attention (4 heads of 8 on 2 KV heads) beside Mamba-2 (4 heads of 8, state 16:
  // mamba_d_ssm 32, not mamba_expand x hidden_size), muP multipliers none of which is 1.
  if (name == "tiny-falcon-h1") {
    TransformerConfig c = FalconH1(97, 32, 2, 4, 2, 8, 48, 4, 8, 16);
    c.mamba.chunk_size = 16;
    c.mup = {2.0, 0.5, 1.5, 0.75, 0.8, 1.25, 0.6, {0.9, 1.1, 0.7, 1.3, 0.5}, 0.85, 0.65};
    return c;
  }
  // Nemotron-H for tests: Mamba-2, MLP, attention, MLP.
  if (name == "tiny-nemotron-h") {
    TransformerConfig c = NemotronH(97, 32, "M-*-", 4, 2, 8, 48, 8, 8, 2, 16);
    c.mamba.chunk_size = 16;
    return c;
  }
  if (name == "demo") return Llama(128, 64, 2, 4, 2, 176);
  if (name == "bench-cpu") return Llama(512, 256, 4, 4, 2, 688);
  // bench-cpu's width and depth as a Qwen3.5 (three Gated DeltaNet layers, one gated attention layer).
  if (name == "bench-cpu-qwen3.5") return Qwen35(512, 256, 4, 4, 2, 64, 688, 2, 4, 64);
  // GPU benchmark shapes (random weights): a 1B Llama (Llama-3.2-1B's layout, 32K vocabulary) and Qwen2.5-7B.
  if (name == "llama-1b-shape") {
    TransformerConfig c = Llama(32000, 2048, 16, 32, 8, 8192);
    c.rope_theta = 500000.0;
    return c;
  }
  // Real models' shapes (config only; weights are random, or none on --device=meta), from their public
  // Hugging Face config.json files.
  // Qwen/Qwen2.5-7B: vocab_size 152064, hidden_size 3584, num_hidden_layers 28, num_attention_heads 28,
  // num_key_value_heads 4, intermediate_size 18944, rms_norm_eps 1e-6, rope_theta 1e6, max_position_embeddings
  // 131072, tie_word_embeddings false. "qwen2.5-7b-shape" is the older name of the same shape (the GPU bench's).
  if (name == "qwen2.5-7b" || name == "qwen2.5-7b-shape") return Qwen25(3584, 28, 28, 4, 18944, 1e-6);
  // Qwen/Qwen2.5-32B: hidden_size 5120, num_hidden_layers 64, num_attention_heads 40, num_key_value_heads 8,
  // intermediate_size 27648, rms_norm_eps 1e-5, rope_theta 1e6, max_position_embeddings 131072, untied.
  if (name == "qwen2.5-32b") return Qwen25(5120, 64, 40, 8, 27648, 1e-5);
  // meta-llama/Llama-3.1-8B: vocab_size 128256, hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
  // num_key_value_heads 8, intermediate_size 14336, rms_norm_eps 1e-5, rope_theta 500000,
  // max_position_embeddings 131072, rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4,
  // original_max_position_embeddings 8192), tie_word_embeddings false.
  if (name == "llama-3.1-8b") {
    TransformerConfig c = Llama(128256, 4096, 32, 32, 8, 14336);
    c.rope_theta = 500000.0;
    c.rope_scaling.type = "llama3";
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 8192;
    return c;
  }
  // Qwen3-8B's layout: q_norm / k_norm, head_dim 128 (32 x 128 = 4096 = d here), 8 KV heads, no biases.
  if (name == "qwen3-8b-shape") {
    TransformerConfig c = Llama(151936, 4096, 36, 32, 8, 12288);
    c.architecture = "qwen3";
    c.head_dim = 128;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
    c.max_position_embeddings = 40960;
    return c;
  }
  // Qwen/Qwen3.5-9B's text_config: vocab_size 248320, hidden_size 4096, num_hidden_layers 32, num_attention_heads
  // 16, num_key_value_heads 4, head_dim 256, intermediate_size 12288, linear_num_key_heads 16,
  // linear_num_value_heads 32, linear key/value head dims 128, full_attention_interval 4, untied.
  if (name == "qwen3.5-9b-shape") return Qwen35(248320, 4096, 32, 16, 4, 256, 12288, 16, 32, 128);
  // Qwen/Qwen3.5-27B's: hidden_size 5120, num_hidden_layers 64, num_attention_heads 24, num_key_value_heads 4,
  // head_dim 256, intermediate_size 17408, linear_num_key_heads 16, linear_num_value_heads 48.
  if (name == "qwen3.5-27b-shape") return Qwen35(248320, 5120, 64, 24, 4, 256, 17408, 16, 48, 128);
  // Qwen/Qwen3-30B-A3B: vocab_size 151936, hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
  // num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768,
  // norm_topk_prob true, rope_theta 1e6, max_position_embeddings 40960, untied.
  if (name == "qwen3-30b-a3b-shape") {
    TransformerConfig c = Llama(151936, 2048, 48, 32, 4, 6144);
    c.architecture = "qwen3_moe";
    c.head_dim = 128;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
    c.max_position_embeddings = 40960;
    WithExperts(c, std::vector<bool>(48, true), 128, 8, 768, /*normalize=*/true);
    return c;
  }
  // Qwen/Qwen3.5-35B-A3B's text_config: hidden_size 2048, num_hidden_layers 40 (three Gated DeltaNet to one
  // attention), num_attention_heads 16, num_key_value_heads 2, head_dim 256, num_experts 256, num_experts_per_tok 8,
  // moe_intermediate_size 512, shared_expert_intermediate_size 512, linear heads 16 / 32 of 128.
  if (name == "qwen3.5-35b-a3b-shape") {
    TransformerConfig c = Qwen35(248320, 2048, 40, 16, 2, 256, 0, 16, 32, 128);
    c.architecture = "qwen3_5_moe_text";
    WithExperts(c, std::vector<bool>(40, true), 256, 8, 512, /*normalize=*/true, /*shared=*/512);
    return c;
  }
  // mistralai/Mixtral-8x7B-v0.1: vocab_size 32000, hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
  // num_key_value_heads 8, intermediate_size 14336 (each expert's), num_local_experts 8, num_experts_per_tok 2,
  // rope_theta 1e6, rms_norm_eps 1e-5, max_position_embeddings 32768.
  if (name == "mixtral-8x7b-shape") {
    TransformerConfig c = Llama(32000, 4096, 32, 32, 8, 14336);
    c.architecture = "mixtral";
    c.rope_theta = 1000000.0;
    c.max_position_embeddings = 32768;
    WithExperts(c, std::vector<bool>(32, true), 8, 2, 14336, /*normalize=*/true);
    return c;
  }
  // state-spaces/mamba2-2.7b: d_model 2560, n_layer 64, vocab_size 50277 padded to a multiple of 16 (50288),
  // d_state 128, headdim 64 (80 heads: expand 2), ngroups 1, d_conv 4, chunk_size 256, tie_embeddings true.
  if (name == "mamba2-2.7b-shape") {
    TransformerConfig c = Mamba2(50288, 2560, 64, 80, 64, 1, 128);
    c.tie_word_embeddings = true;
    return c;
  }
  // ibm-ai-platform/Bamba-9B: vocab_size 128256, hidden_size 4096, num_hidden_layers 32, attn_layer_indices
  // [9, 18, 27], num_attention_heads 32, num_key_value_heads 8, intermediate_size 14336, mamba_n_heads 128,
  // mamba_d_head 64, mamba_n_groups 1, mamba_d_state 128, mamba_d_conv 4, mamba_chunk_size 256, rope_theta 1e4.
  if (name == "bamba-9b-shape") return Bamba(128256, 4096, 32, 32, 8, 14336, 128, 128, {9, 18, 27});
  // nvidia/Nemotron-H-8B-Base-8K: vocab_size 131072, hidden_size 4096, hybrid_override_pattern (52 layers, 4 of
  // attention) below, num_attention_heads 32, num_key_value_heads 8, head_dim 128, intermediate_size 21504,
  // mamba_num_heads 128, mamba_head_dim 64, n_groups 8, ssm_state_size 128, conv_kernel 4, chunk_size 128.
  if (name == "nemotron-h-8b-shape")
    return NemotronH(131072, 4096, "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 32, 8, 128, 21504, 128, 64,
                     8, 128);
  // tiiuae/Falcon-H1-7B-Instruct: vocab_size 130048, hidden_size 3072, num_hidden_layers 44, num_attention_heads 12,
  // num_key_value_heads 2, head_dim 128, intermediate_size 12288, mamba_n_heads 24, mamba_d_head 128, mamba_d_ssm
  // 3072, mamba_n_groups 1, mamba_d_state 256, mamba_d_conv 4, mamba_chunk_size 128, max_position_embeddings 262144.
  if (name == "falcon-h1-7b-shape") {
    TransformerConfig c = FalconH1(130048, 3072, 44, 12, 2, 128, 12288, 24, 128, 256);
    c.mamba.chunk_size = 128;
    c.max_position_embeddings = 262144;
    return c;
  }
  return absl::NotFoundError(
      absl::StrCat("'", name, "' is not a transformer preset (", absl::StrJoin(TransformerPresetNames(), ", "), ")"));
}

}  // namespace sg
