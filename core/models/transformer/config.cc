#include "core/models/transformer/config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/io/config_fields.h"
#include "nlohmann/json.hpp"

namespace sg {

int64_t TransformerConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

double DynamicRopeBase(const TransformerConfig& c, int64_t tokens) {
  const double m = static_cast<double>(c.max_position_embeddings);
  const double past = std::max(0.0, static_cast<double>(tokens) - m);
  const double d = static_cast<double>(c.rotary_dim());
  return c.rope_theta * std::pow(1 + c.rope_scaling.factor * past / m, d / (d - 2));
}

absl::StatusOr<ModelFootprint> Footprint(const TransformerConfig& c, DType dtype) {
  if (absl::Status s = CheckConfigBounds({{"vocab_size", c.vocab_size, INT32_MAX},
                                          {"hidden_size", c.hidden_size, INT64_MAX},
                                          {"num_hidden_layers", c.num_layers, INT32_MAX}});
      !s.ok())
    return s;
  const int64_t A = c.attention_layer_count();  // layers with attention (alone or beside Mamba-2)
  if (A > 0)
    if (absl::Status s = CheckConfigBounds({{"num_attention_heads", c.num_heads, INT32_MAX},
                                            {"num_key_value_heads", c.num_kv_heads, INT32_MAX},
                                            {"head_dim", c.head_dim, INT64_MAX},
                                            {"max_position_embeddings", c.max_position_embeddings, INT64_MAX}});
        !s.ok())
      return s;
  const int64_t moe_layers = c.moe_layer_count();  // sparse MoE blocks in place of SwiGLU MLPs
  const int64_t swiglu = c.mlp_count(Mlp::kSwiGlu) - moe_layers, relu2 = c.mlp_count(Mlp::kRelu2);
  if (swiglu + relu2 > 0)
    if (absl::Status s = CheckConfigBounds({{"intermediate_size", c.intermediate_size, INT64_MAX}}); !s.ok()) return s;
  FootprintCounter n(dtype);
  const int64_t d = c.hidden_size, L = c.num_layers, f = c.intermediate_size;
  const int64_t linear = c.linear_layer_count();  // Gated DeltaNet layers
  const int64_t qd = n.Product({{"num_attention_heads", c.num_heads}, {"head_dim", c.head_dim}});
  const int64_t kvd = n.Product({{"num_key_value_heads", c.num_kv_heads}, {"head_dim", c.head_dim}});
  n.Add(n.Product({{"vocab_size", c.vocab_size}, {"hidden_size", d}}), c.tie_word_embeddings ? 1 : 2);
  // the norms before each mixer and MLP, the final norm
  n.Add(d, 2 * L - c.mixer_count(Mixer::kNone) - c.mlp_count(Mlp::kNone) + 1);
  // q (with a gate per value in hybrids' gated attention), o
  n.Add(n.Product({{"num_attention_heads x head_dim", qd}, {"hidden_size", d}}), (c.hybrid() ? 3 : 2) * A);
  n.Add(n.Product({{"num_key_value_heads x head_dim", kvd}, {"hidden_size", d}}), 2 * A);    // k, v
  n.Add(n.Product({{"intermediate_size", f}, {"hidden_size", d}}), 3 * swiglu + 2 * relu2);  // gate, up, down
  if (moe_layers > 0) {
    const MoeConfig& m = c.moe;
    const int64_t expert = n.Product({{"moe_intermediate_size", m.intermediate}, {"hidden_size", d}});
    n.Add(n.Product({{"num_experts", m.experts}, {"hidden_size", d}}), moe_layers);  // router
    n.AddExperts(n.Product({{"num_experts", m.experts}, {"moe_intermediate_size x hidden_size", 2 * expert}}),
                 moe_layers);  // gate_up_proj
    n.AddExperts(n.Product({{"num_experts", m.experts}, {"moe_intermediate_size x hidden_size", expert}}),
                 moe_layers);  // down_proj
    if (m.shared_intermediate > 0) {
      n.Add(n.Product({{"shared_expert_intermediate_size", m.shared_intermediate}, {"hidden_size", d}}),
            3 * moe_layers);
      n.Add(d, moe_layers);  // the shared expert's gate
    }
  }
  if (c.attention_bias) {
    n.Add(qd * (c.hybrid() ? 2 : 1), A);
    n.Add(kvd, 2 * A);
  }
  if (c.o_bias()) n.Add(d, A);
  if (c.mlp_bias) {
    n.Add(f, 2 * swiglu + relu2);
    n.Add(d, swiglu + relu2);
  }
  if (c.qk_norm()) n.Add(c.head_dim, 2 * A);
  if (A > 0 && c.rope) n.Add(c.rotary_dim() / 2);  // RoPE frequencies
  if (const int64_t M = c.mamba_layer_count(); M > 0) {
    const Mamba2Config& m = c.mamba;
    const int64_t I = n.Product({{"mamba heads", m.heads}, {"mamba head_dim", m.head_dim}});
    const int64_t rows = n.Product({{"mamba in_proj rows", I + m.conv_dim() + m.heads}, {"hidden_size", d}});
    n.Add(rows, M);                                                                                // in_proj
    n.Add(n.Product({{"mamba conv channels", m.conv_dim()}, {"conv_kernel", m.conv_kernel}}), M);  // conv1d
    n.Add(n.Product({{"hidden_size", d}, {"mamba intermediate", I}}), M);                          // out_proj
    n.Add(m.heads, 3 * M);                                                                         // dt_bias, A_log, D
    if (m.gated_norm) n.Add(I, M);  // the gated norm (Falcon-H1's mamba_rms_norm)
    if (m.conv_bias) n.Add(m.conv_dim(), M);
    if (m.proj_bias) {
      n.Add(m.in_proj_rows(), M);
      n.Add(d, M);
    }
  }
  if (linear > 0) {
    const LinearAttentionConfig& a = c.linear;
    const int64_t conv = n.Product({{"linear conv channels", a.conv_dim()}, {"linear_conv_kernel_dim", a.conv_kernel}});
    n.Add(n.Product({{"linear conv channels", a.conv_dim()}, {"hidden_size", d}}), linear);   // in_proj q, k, v
    n.Add(n.Product({{"linear value dim", a.value_dim()}, {"hidden_size", d}}), 2 * linear);  // in_proj z, out_proj
    n.Add(n.Product({{"linear_num_value_heads", a.value_heads}, {"hidden_size", d}}), 2 * linear);  // b, a
    n.Add(conv, linear);
    n.Add(a.value_heads, 2 * linear);  // A_log, dt_bias
    n.Add(a.value_head_dim, linear);   // the gated norm
  }
  return n.Result();
}

namespace io {
namespace {

using internal::AbslView;
using internal::JsonTypeName;
using nlohmann::json;

// "llama", "qwen2" or "qwen3" from model_type, or from architectures when model_type
// is absent (some older exports omit it).
absl::StatusOr<std::string> DetectArchitecture(const FieldReader& fields, const std::string& source_name) {
  std::optional<std::string> model_type;
  SG_IO_ASSIGN_OR_RETURN(model_type, fields.String("model_type"));
  if (model_type) {
    for (const char* type : {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text", "qwen3_5",
                             "qwen3_5_moe_text", "qwen3_5_moe", "mamba2", "bamba", "nemotron_h", "falcon_h1"})
      if (*model_type == type) return *model_type;
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": model_type '", *model_type,
                                                   "' is not supported (supported: llama, qwen2, qwen3, qwen3_moe, "
                                                   "mixtral, qwen3_next, qwen3_5_text, qwen3_5, qwen3_5_moe_text, "
                                                   "qwen3_5_moe, mamba2, bamba, nemotron_h, falcon_h1)"));
  }
  const json* architectures = fields.Get("architectures");
  if (architectures == nullptr) {
    return fields.Error("model_type", "is missing (and no 'architectures' to infer it from)");
  }
  if (!architectures->is_array()) {
    return fields.Error("architectures", absl::StrCat("must be an array, got ", JsonTypeName(*architectures)));
  }
  std::vector<std::string> names;
  for (const json& name : *architectures) {
    if (name == "LlamaForCausalLM") return std::string("llama");
    if (name == "Qwen2ForCausalLM") return std::string("qwen2");
    if (name == "Qwen3ForCausalLM") return std::string("qwen3");
    if (name == "Qwen3NextForCausalLM") return std::string("qwen3_next");
    if (name == "Qwen3_5ForCausalLM") return std::string("qwen3_5_text");
    if (name == "Qwen3_5ForConditionalGeneration") return std::string("qwen3_5");
    if (name == "Qwen3MoeForCausalLM") return std::string("qwen3_moe");
    if (name == "MixtralForCausalLM") return std::string("mixtral");
    if (name == "Qwen3_5MoeForCausalLM") return std::string("qwen3_5_moe_text");
    if (name == "Qwen3_5MoeForConditionalGeneration") return std::string("qwen3_5_moe");
    if (name == "Mamba2ForCausalLM") return std::string("mamba2");
    if (name == "BambaForCausalLM") return std::string("bamba");
    if (name == "NemotronHForCausalLM") return std::string("nemotron_h");
    if (name == "FalconH1ForCausalLM") return std::string("falcon_h1");
    // Described rather than dumped: dump() recurses, and the value is untrusted.
    names.push_back(name.is_string() ? absl::StrCat("'", name.get_ref<const std::string&>(), "'") : JsonTypeName(name));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(source_name, ": architectures [", absl::StrJoin(names, ", "),
                   "] are not supported (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                   "Qwen3MoeForCausalLM, MixtralForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, "
                   "Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, "
                   "Mamba2ForCausalLM, BambaForCausalLM, NemotronHForCausalLM, FalconH1ForCausalLM)"));
}

// The scaling factor of a RoPE block (rope_scaling.original_max_position_embeddings set). yarn's null factor is
// max_position_embeddings / original_max_position_embeddings (transformers' DeepSeek-V3 rule); an absent one is
// refused, as transformers 5.23 refuses it. A factor below 1 compresses positions instead of stretching them:
// transformers warns that it must be >= 1; refused here.
absl::Status ParseRopeFactor(const FieldReader& rope, TransformerConfig& config) {
  RopeScaling& scaling = config.rope_scaling;
  const bool derived = scaling.type == "yarn" && rope.Has("factor") && rope.Get("factor") == nullptr;
  std::optional<double> fallback;
  if (derived)
    fallback = static_cast<double>(config.max_position_embeddings) / scaling.original_max_position_embeddings;
  SG_IO_ASSIGN_OR_RETURN(scaling.factor, rope.PositiveNumber("factor", fallback));
  if (scaling.factor >= 1) return absl::OkStatus();
  return rope.Error("factor", absl::StrCat("is ", scaling.factor,
                                           derived ? " (null: max_position_embeddings / "
                                                     "original_max_position_embeddings)"
                                                   : "",
                                           "; it must be >= 1 (transformers 5.23 warns and compresses the "
                                           "positions)"));
}

// A RoPE block as transformers reads it: its type under "rope_type", its rope_theta, else the top-level one.
json StandardRopeBlock(const json& block, double rope_theta) {
  json out = block;
  if (!out.is_object()) return out;
  if (!out.contains("rope_type") && out.contains("type")) out["rope_type"] = out["type"];
  out.erase("type");
  if (!out.contains("rope_theta") || out["rope_theta"].is_null()) out["rope_theta"] = rope_theta;
  return out;
}

// Partial RoPE (hybrids) rotates the first head_dim x partial_rotary_factor dims of a head: an even number, at
// least 2 and at most head_dim. Llama, Qwen2 and Qwen3 rotate whole heads.
absl::Status CheckRotaryDim(const FieldReader& fields, const TransformerConfig& config) {
  const double f = config.partial_rotary_factor;
  if (!config.hybrid() && config.architecture != "bamba" && f != 1.0)
    return fields.Error("partial_rotary_factor",
                        absl::StrCat("is ", f, "; ", config.architecture, " rotates whole heads (1)"));
  const int64_t dim = config.rotary_dim();
  if (f > 1.0 || dim < 2 || dim % 2 != 0)
    return fields.Error("partial_rotary_factor",
                        absl::StrCat("is ", f, ": head_dim (", config.head_dim, ") x it = ", dim,
                                     " rotated dims; they must be even, at least 2 and at most head_dim"));
  return absl::OkStatus();
}

// Dynamic RoPE's base must stay finite up to this sequence length (tokens).
constexpr int64_t kLongestDynamicRopeCheck = int64_t{1} << 31;

// Sets rope_theta and rope_scaling, with transformers' defaults. transformers >= 5 writes one "rope_parameters"
// object (rope_theta inside it); older versions write a top-level "rope_theta" plus "rope_scaling". Needs
// max_position_embeddings and head_dim. What transformers 5.23 only warns about, or silently ignores, is refused
// where it would compute something else than the config says.
absl::Status ParseRope(const FieldReader& fields, const std::string& source_name, TransformerConfig& config) {
  // MixtralConfig's default_theta is 1e6; the others' 1e4.
  SG_IO_ASSIGN_OR_RETURN(config.rope_theta,
                         fields.PositiveNumber("rope_theta", config.architecture == "mixtral" ? 1e6 : 10000.0));
  const json* parameters = fields.Get("rope_parameters");
  const json* legacy = fields.Get("rope_scaling");
  if (parameters && legacy &&
      StandardRopeBlock(*parameters, config.rope_theta) != StandardRopeBlock(*legacy, config.rope_theta))
    return fields.Error("rope_scaling",
                        "and field 'rope_parameters' are both given and differ; transformers 5.23 "
                        "would use rope_scaling and drop rope_parameters, its rope_theta included: "
                        "keep one");
  const std::string block_name = parameters ? "rope_parameters" : "rope_scaling";
  const json* block = parameters ? parameters : legacy;
  if (block == nullptr) return absl::OkStatus();
  if (!block->is_object()) {
    return fields.Error(block_name, absl::StrCat("must be an object or null, got ", JsonTypeName(*block)));
  }
  const FieldReader rope(*block, source_name, block_name + ".");
  SG_IO_ASSIGN_OR_RETURN(config.rope_theta, rope.PositiveNumber("rope_theta", config.rope_theta));
  SG_IO_ASSIGN_OR_RETURN(config.partial_rotary_factor,
                         rope.PositiveNumber("partial_rotary_factor", config.partial_rotary_factor));
  if (rope.Has("partial_rotary_factor"))
    if (absl::Status s = CheckRotaryDim(rope, config); !s.ok()) return s;
  // Newer configs say "rope_type", older ones "type"; transformers takes rope_type when both are there.
  std::optional<std::string> type, old_type;
  SG_IO_ASSIGN_OR_RETURN(type, rope.String("rope_type"));
  SG_IO_ASSIGN_OR_RETURN(old_type, rope.String("type"));
  if (type && old_type && *type != *old_type)
    return rope.Error("type", absl::StrCat("is '", *old_type, "' but rope_type is '", *type,
                                           "'; transformers 5.23 would use rope_type and ignore type: keep one"));
  const std::string type_field = type ? "rope_type" : "type";
  if (!type) type = old_type;
  if (!type) return rope.Error("rope_type", "is missing");
  RopeScaling& scaling = config.rope_scaling;
  scaling.type = *type;
  if (scaling.type == "default") return absl::OkStatus();
  if (scaling.type != "linear" && scaling.type != "dynamic" && scaling.type != "yarn" && scaling.type != "llama3")
    return rope.Error(type_field, absl::StrCat("is '", scaling.type,
                                               "', which is not supported (supported: default, linear, dynamic, "
                                               "yarn, llama3)"));
  // The pretraining context: a top-level original_max_position_embeddings (Phi-3 style) wins, as in transformers.
  int64_t original_context;
  SG_IO_ASSIGN_OR_RETURN(original_context,
                         fields.PositiveInt("original_max_position_embeddings", config.max_position_embeddings));
  if (fields.Get("original_max_position_embeddings") == nullptr)
    SG_IO_ASSIGN_OR_RETURN(original_context, rope.PositiveInt("original_max_position_embeddings", original_context));
  scaling.original_max_position_embeddings = original_context;
  if (absl::Status s = ParseRopeFactor(rope, config); !s.ok()) return s;
  if (scaling.type == "yarn") {
    SG_IO_ASSIGN_OR_RETURN(scaling.attention_factor, rope.PositiveNumber("attention_factor", 0.0));
    SG_IO_ASSIGN_OR_RETURN(scaling.mscale, rope.PositiveNumber("mscale", 0.0));
    SG_IO_ASSIGN_OR_RETURN(scaling.mscale_all_dim, rope.PositiveNumber("mscale_all_dim", 0.0));
    SG_IO_ASSIGN_OR_RETURN(scaling.beta_fast, rope.PositiveNumber("beta_fast", 32.0));
    SG_IO_ASSIGN_OR_RETURN(scaling.beta_slow, rope.PositiveNumber("beta_slow", 1.0));
    SG_IO_ASSIGN_OR_RETURN(scaling.truncate, rope.Bool("truncate", true));
    // Reversed, the ramp would interpolate the fast dimensions and keep the slow ones.
    if (scaling.beta_fast < scaling.beta_slow)
      return rope.Error("beta_fast",
                        absl::StrCat("(", scaling.beta_fast, ") is less than beta_slow (", scaling.beta_slow,
                                     "); it must not be (transformers 5.23 warns and reverses yarn's ramp)"));
    return absl::OkStatus();
  }
  if (scaling.type == "dynamic") {
    // NTK's exponent is d / (d - 2), d the rotated dims.
    if (config.rotary_dim() <= 2)
      return fields.Error("head_dim", absl::StrCat("is ", config.head_dim,
                                                   "; dynamic RoPE needs more than 2 rotated "
                                                   "dims (head_dim x partial_rotary_factor)"));
    if (!std::isfinite(DynamicRopeBase(config, kLongestDynamicRopeCheck)))
      return rope.Error("factor", absl::StrCat("is ", scaling.factor, ": dynamic RoPE's base overflows (at ",
                                               kLongestDynamicRopeCheck,
                                               " tokens), where transformers 5.23 "
                                               "computes infinite or NaN frequencies"));
  }
  if (scaling.type != "llama3") return absl::OkStatus();
  SG_IO_ASSIGN_OR_RETURN(scaling.low_freq_factor, rope.PositiveNumber("low_freq_factor"));
  SG_IO_ASSIGN_OR_RETURN(scaling.high_freq_factor, rope.PositiveNumber("high_freq_factor"));
  // The llama3 wavelength interpolation divides by their difference.
  if (scaling.high_freq_factor <= scaling.low_freq_factor) {
    return rope.Error("high_freq_factor", "must be greater than low_freq_factor");
  }
  return absl::OkStatus();
}

// Hybrids and mixtures of experts keep a flag per layer: past this many layers (real models have a few hundred at
// most) a config is refused before the lists are made.
constexpr int64_t kMostListedLayers = int64_t{1} << 16;
absl::Status TooManyLayers(const FieldReader& fields, const TransformerConfig& config) {
  return fields.Error("num_hidden_layers", absl::StrCat("is ", config.num_layers, "; ", config.architecture,
                                                        " models are supported up to ", kMostListedLayers, " layers"));
}

// transformers >= 5 lists each layer's attention kind: full attention everywhere, and in hybrids
// "linear_attention" (Gated DeltaNet) too, by default in every layer but each full_attention_interval-th.
absl::Status ParseLayerTypes(const FieldReader& fields, TransformerConfig& config) {
  const json* layer_types = fields.Get("layer_types");
  if (layer_types == nullptr) {
    if (!config.hybrid()) return absl::OkStatus();
    int64_t interval;
    SG_IO_ASSIGN_OR_RETURN(interval, fields.PositiveInt("full_attention_interval", 4));
    if (config.num_layers > kMostListedLayers) return TooManyLayers(fields, config);
    for (int64_t i = 0; i < config.num_layers; ++i)
      config.mixers.push_back((i + 1) % interval != 0 ? Mixer::kDeltaNet : Mixer::kAttention);
    if (interval == 1) config.mixers.clear();  // every layer full attention
    return absl::OkStatus();
  }
  if (!layer_types->is_array()) {
    return fields.Error("layer_types", absl::StrCat("must be an array, got ", JsonTypeName(*layer_types)));
  }
  if (static_cast<int64_t>(layer_types->size()) != config.num_layers)
    return fields.Error("layer_types", absl::StrCat("lists ", layer_types->size(), " layers; num_hidden_layers is ",
                                                    config.num_layers));
  const char* supported = config.hybrid() ? "'full_attention' and 'linear_attention' are" : "only 'full_attention' is";
  for (const json& type : *layer_types) {
    const bool linear = config.hybrid() && type == "linear_attention";
    if (type != "full_attention" && !linear) {
      return fields.Error("layer_types",
                          absl::StrCat("has ",
                                       type.is_string() ? absl::StrCat("'", type.get_ref<const std::string&>(), "'")
                                                        : JsonTypeName(type),
                                       "; ", supported, " supported for ", config.architecture));
    }
    config.mixers.push_back(linear ? Mixer::kDeltaNet : Mixer::kAttention);
  }
  if (config.linear_layer_count() == 0) config.mixers.clear();  // every layer full attention
  return absl::OkStatus();
}

// Gated DeltaNet's shapes (transformers' defaults).
absl::Status ParseLinearAttention(const FieldReader& fields, TransformerConfig& config) {
  LinearAttentionConfig& a = config.linear;
  SG_IO_ASSIGN_OR_RETURN(a.conv_kernel, fields.PositiveInt("linear_conv_kernel_dim", 4));
  SG_IO_ASSIGN_OR_RETURN(a.key_head_dim, fields.PositiveInt("linear_key_head_dim", 128));
  SG_IO_ASSIGN_OR_RETURN(a.value_head_dim, fields.PositiveInt("linear_value_head_dim", 128));
  SG_IO_ASSIGN_OR_RETURN(a.key_heads, fields.PositiveInt("linear_num_key_heads", 16));
  SG_IO_ASSIGN_OR_RETURN(a.value_heads, fields.PositiveInt("linear_num_value_heads", 32));
  if (a.value_heads % a.key_heads != 0)
    return fields.Error("linear_num_value_heads", absl::StrCat("(", a.value_heads,
                                                               ") must be a multiple of "
                                                               "linear_num_key_heads (",
                                                               a.key_heads, ")"));
  return absl::OkStatus();
}

}  // namespace

namespace {

// A number >= 0 (absent: fallback).
absl::StatusOr<double> NonNegativeNumber(const FieldReader& fields, const char* field, double fallback) {
  const json* value = fields.Get(field);
  if (value == nullptr) return fallback;
  if (!value->is_number() || !(value->get<double>() >= 0) || !std::isfinite(value->get<double>()))
    return fields.Error(field, absl::StrCat("must be a finite number >= 0, got ", value->dump()));
  return value->get<double>();
}

// Mixtures of experts, with transformers 5.23's defaults: which layers' MLP is a sparse MoE block (Qwen3-MoE and
// Qwen3-Next: where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; Mixtral and Qwen3.5-MoE:
// every layer), and its shapes.
absl::Status ParseMoe(const FieldReader& fields, TransformerConfig& config) {
  const std::string& arch = config.architecture;
  const bool mixtral = arch == "mixtral", next = arch == "qwen3_next", q35 = arch == "qwen3_5_moe_text";
  const bool q3 = arch == "qwen3_moe";
  if (!mixtral && !next && !q35 && !q3) return absl::OkStatus();
  MoeConfig& m = config.moe;
  // transformers 5.23 writes Qwen3-MoE's count as num_local_experts (Mixtral's name), the others' as num_experts.
  const char* experts_field = fields.Get("num_local_experts") ? "num_local_experts" : "num_experts";
  if (fields.Get("num_local_experts") && fields.Get("num_experts") &&
      *fields.Get("num_local_experts") != *fields.Get("num_experts"))
    return fields.Error("num_experts", "and num_local_experts differ; give one");
  const json* experts = fields.Get(experts_field);
  if (experts && !experts->is_number_integer())
    return fields.Error(experts_field, absl::StrCat("must be an integer, got ", JsonTypeName(*experts)));
  m.experts = experts ? experts->get<int64_t>() : mixtral ? 8 : next ? 512 : q35 ? 256 : 128;
  if (m.experts < 0 || ((mixtral || q35) && m.experts == 0))
    return fields.Error(experts_field, absl::StrCat("must be positive, got ", m.experts));
  if (m.experts == 0) return absl::OkStatus();  // Qwen3-MoE / Qwen3-Next without experts: dense MLPs
  SG_IO_ASSIGN_OR_RETURN(m.top_k, fields.PositiveInt("num_experts_per_tok", mixtral ? 2 : next ? 10 : 8));
  if (m.top_k > m.experts)
    return fields.Error("num_experts_per_tok",
                        absl::StrCat("(", m.top_k, ") exceeds ", experts_field, " (", m.experts, ")"));
  if (mixtral) {
    m.intermediate = config.intermediate_size;
  } else {
    SG_IO_ASSIGN_OR_RETURN(m.intermediate, fields.PositiveInt("moe_intermediate_size", q3 ? 768 : 512));
  }
  if (q3 || next) SG_IO_ASSIGN_OR_RETURN(m.normalize, fields.Bool("norm_topk_prob", next));
  if (next || q35)
    SG_IO_ASSIGN_OR_RETURN(m.shared_intermediate, fields.PositiveInt("shared_expert_intermediate_size", 512));
  SG_IO_ASSIGN_OR_RETURN(m.aux_loss, fields.Bool("output_router_logits", false));
  SG_IO_ASSIGN_OR_RETURN(m.aux_loss_coef, NonNegativeNumber(fields, "router_aux_loss_coef", 0.001));
  if (mixtral) {
    double jitter;
    SG_IO_ASSIGN_OR_RETURN(jitter, NonNegativeNumber(fields, "router_jitter_noise", 0.0));
    if (jitter > 0)
      return fields.Error("router_jitter_noise", absl::StrCat("is ", jitter,
                                                              "; random router noise in training is "
                                                              "not supported (0)"));
    if (fields.Get("sliding_window") != nullptr)
      return fields.Error("sliding_window", "is set; sliding-window attention is not supported (null)");
  }
  if (config.num_layers > kMostListedLayers) return TooManyLayers(fields, config);
  std::vector<bool> dense(config.num_layers, false);
  int64_t step = 1;
  if (q3 || next) {
    SG_IO_ASSIGN_OR_RETURN(step, fields.PositiveInt("decoder_sparse_step", 1));
    if (const json* only = fields.Get("mlp_only_layers")) {
      if (!only->is_array()) return fields.Error("mlp_only_layers", "must be an array of layer indices");
      for (const json& i : *only) {
        if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= config.num_layers)
          return fields.Error("mlp_only_layers", absl::StrCat("holds ", i.dump(), ", not a layer index"));
        dense[i.get<int64_t>()] = true;
      }
    }
  }
  for (int64_t i = 0; i < config.num_layers; ++i) config.moe_layers.push_back(!dense[i] && (i + 1) % step == 0);
  if (std::find(config.moe_layers.begin(), config.moe_layers.end(), true) == config.moe_layers.end())
    config.moe_layers.clear();
  return absl::OkStatus();
}

// The fields of one text model of `architecture` (a config.json, or a conditional model's text_config).
absl::StatusOr<TransformerConfig> ParseTextConfig(const FieldReader& fields, const std::string& source_name,
                                                  const std::string& architecture) {
  TransformerConfig config;
  config.architecture = architecture;
  const bool is_qwen2 = config.architecture == "qwen2", is_qwen3 = config.architecture == "qwen3";
  const bool hybrid = config.hybrid(), mixtral = config.architecture == "mixtral";
  const bool qwen = is_qwen2 || is_qwen3 || hybrid || config.architecture == "qwen3_moe";

  SG_IO_ASSIGN_OR_RETURN(config.vocab_size, fields.PositiveInt("vocab_size"));
  SG_IO_ASSIGN_OR_RETURN(config.hidden_size, fields.PositiveInt("hidden_size"));
  SG_IO_ASSIGN_OR_RETURN(config.num_layers, fields.PositiveInt("num_hidden_layers"));
  SG_IO_ASSIGN_OR_RETURN(config.num_heads, fields.PositiveInt("num_attention_heads"));
  SG_IO_ASSIGN_OR_RETURN(config.num_kv_heads, fields.PositiveInt("num_key_value_heads", config.num_heads));
  if (config.num_heads % config.num_kv_heads != 0) {
    return fields.Error(
        "num_key_value_heads",
        absl::StrCat("(", config.num_kv_heads, ") must divide num_attention_heads (", config.num_heads, ")"));
  }
  if (fields.Get("head_dim") == nullptr && !is_qwen3 && !hybrid && config.hidden_size % config.num_heads != 0) {
    return fields.Error("hidden_size",
                        absl::StrCat("(", config.hidden_size, ") must be divisible by num_attention_heads (",
                                     config.num_heads, ") when head_dim is not given"));
  }
  // Qwen3Config's head_dim defaults to 128, the hybrids' to 256, not hidden_size / num_attention_heads.
  SG_IO_ASSIGN_OR_RETURN(config.head_dim,
                         fields.PositiveInt("head_dim", is_qwen3 ? 128
                                                        : hybrid ? 256
                                                                 : config.hidden_size / config.num_heads));
  // Qwen3.5-MoE has no dense MLP, hence no intermediate_size.
  SG_IO_ASSIGN_OR_RETURN(
      config.intermediate_size,
      fields.PositiveInt("intermediate_size",
                         config.architecture == "qwen3_5_moe_text" ? std::optional<int64_t>(0) : std::nullopt));
  // Defaults are those of HF's LlamaConfig / Qwen2Config / MixtralConfig.
  SG_IO_ASSIGN_OR_RETURN(config.rms_norm_eps, fields.PositiveNumber("rms_norm_eps", mixtral ? 1e-5 : 1e-6));
  SG_IO_ASSIGN_OR_RETURN(config.max_position_embeddings,
                         fields.PositiveInt("max_position_embeddings", qwen      ? 32768
                                                                       : mixtral ? 131072
                                                                                 : 2048));
  // The hybrids' configs default partial_rotary_factor to 0.25 (top level, or in the RoPE block).
  SG_IO_ASSIGN_OR_RETURN(config.partial_rotary_factor,
                         fields.PositiveNumber("partial_rotary_factor", hybrid ? 0.25 : 1.0));
  if (absl::Status status = ParseRope(fields, source_name, config); !status.ok()) return status;
  if (absl::Status status = CheckRotaryDim(fields, config); !status.ok()) return status;
  if (hybrid && config.rope_scaling.type != "default")
    return fields.Error(fields.Get("rope_parameters") ? "rope_parameters" : "rope_scaling",
                        absl::StrCat("has rope_type '", config.rope_scaling.type, "'; ", config.architecture,
                                     " models use the default RoPE"));
  SG_IO_ASSIGN_OR_RETURN(config.tie_word_embeddings, fields.Bool("tie_word_embeddings", false));
  // Qwen2 always has q/k/v biases; Llama and Qwen3 have them (and o_proj's) only when asked, and only Llama has
  // an mlp_bias option.
  if (is_qwen2) {
    config.attention_bias = true;
  } else {
    SG_IO_ASSIGN_OR_RETURN(config.attention_bias, fields.Bool("attention_bias", false));
  }
  if (config.architecture == "llama") SG_IO_ASSIGN_OR_RETURN(config.mlp_bias, fields.Bool("mlp_bias", false));

  // Options that change the network in ways the engine does not implement.
  std::optional<std::string> hidden_act;
  SG_IO_ASSIGN_OR_RETURN(hidden_act, fields.String("hidden_act"));
  if (hidden_act && *hidden_act != "silu") {
    return fields.Error("hidden_act", absl::StrCat("is '", *hidden_act, "'; only 'silu' is supported"));
  }
  bool sliding_window;
  SG_IO_ASSIGN_OR_RETURN(sliding_window, fields.Bool("use_sliding_window", false));
  if (sliding_window) return fields.Error("use_sliding_window", "is true, which is not supported");
  if (absl::Status status = ParseLayerTypes(fields, config); !status.ok()) return status;
  if (hybrid)
    if (absl::Status status = ParseLinearAttention(fields, config); !status.ok()) return status;
  if (absl::Status status = ParseMoe(fields, config); !status.ok()) return status;
  return config;
}

}  // namespace

absl::Status ParseTransformerRope(const FieldReader& fields, const std::string& source_name,
                                  TransformerConfig& config) {
  if (absl::Status status = ParseRope(fields, source_name, config); !status.ok()) return status;
  if (absl::Status status = CheckRotaryDim(fields, config); !status.ok()) return status;
  if (config.rope_scaling.type == "default") return absl::OkStatus();
  return fields.Error(fields.Get("rope_parameters") ? "rope_parameters" : "rope_scaling",
                      absl::StrCat("has rope_type '", config.rope_scaling.type, "'; ", config.architecture,
                                   " models are supported with the default RoPE"));
}

absl::StatusOr<TransformerConfig> ParseTransformerConfig(const std::string& json_text, const std::string& source_name) {
  absl::StatusOr<json> parsed = ParseConfigObject(json_text, source_name);
  if (!parsed.ok()) return parsed.status();
  const FieldReader fields(*parsed, source_name);
  std::string architecture;
  SG_IO_ASSIGN_OR_RETURN(architecture, DetectArchitecture(fields, source_name));
  TransformerConfig probe;
  probe.architecture = architecture;
  if (probe.mamba_family()) return ParseMamba2FamilyConfig(fields, source_name, architecture);
  if (architecture != "qwen3_5" && architecture != "qwen3_5_moe")
    return ParseTextConfig(fields, source_name, architecture);
  const std::string text_architecture = architecture + "_text";
  // Qwen3_5ForConditionalGeneration: the text model is text_config; its head may be tied at the top level.
  const json* text = fields.Get("text_config");
  if (text == nullptr || !text->is_object())
    return fields.Error(
        "text_config", text ? absl::StrCat("must be an object, got ", JsonTypeName(*text)) : std::string("is missing"));
  const FieldReader text_fields(*text, source_name, "text_config.");
  std::optional<std::string> text_type;
  SG_IO_ASSIGN_OR_RETURN(text_type, text_fields.String("model_type"));
  if (text_type && *text_type != text_architecture)
    return text_fields.Error(
        "model_type", absl::StrCat("is '", *text_type, "'; a ", architecture, " model's is '", text_architecture, "'"));
  absl::StatusOr<TransformerConfig> config = ParseTextConfig(text_fields, source_name, text_architecture);
  if (!config.ok()) return config.status();
  config->conditional = true;
  bool tied;
  SG_IO_ASSIGN_OR_RETURN(tied, fields.Bool("tie_word_embeddings", config->tie_word_embeddings));
  config->tie_word_embeddings = tied;
  return config;
}

absl::StatusOr<TransformerConfig> LoadTransformerConfig(const std::string& path) {
  absl::StatusOr<std::pair<std::string, std::string>> text = ReadConfigJson(path);
  if (!text.ok()) return text.status();
  return ParseTransformerConfig(text->first, text->second);
}

namespace {

// A hybrid's text config as transformers 5 writes it: one rope_parameters block, the layer types, Gated DeltaNet's
// shapes, and (Qwen3-Next) no experts.
// The mixture-of-experts fields transformers reads (dense layers, where some are, as mlp_only_layers).
void AddMoeJson(const TransformerConfig& config, nlohmann::ordered_json& out) {
  const std::string& arch = config.architecture;
  const MoeConfig& m = config.moe;
  if (config.moe_layers.empty()) {
    if (arch == "qwen3_next" || arch == "qwen3_moe") out["num_experts"] = 0;
    return;
  }
  out[arch == "mixtral" ? "num_local_experts" : "num_experts"] = m.experts;
  out["num_experts_per_tok"] = m.top_k;
  if (arch == "mixtral") {
    out["intermediate_size"] = m.intermediate;
  } else {
    out["moe_intermediate_size"] = m.intermediate;
  }
  if (arch == "qwen3_moe" || arch == "qwen3_next") {
    out["norm_topk_prob"] = m.normalize;
    out["decoder_sparse_step"] = 1;
    nlohmann::ordered_json& dense = out["mlp_only_layers"] = nlohmann::ordered_json::array();
    for (int64_t l = 0; l < config.num_layers; ++l)
      if (!config.is_moe(l)) dense.push_back(l);
  }
  if (m.shared_intermediate > 0) out["shared_expert_intermediate_size"] = m.shared_intermediate;
  out["output_router_logits"] = m.aux_loss;
  out["router_aux_loss_coef"] = m.aux_loss_coef;
}

nlohmann::ordered_json HybridTextJson(const TransformerConfig& config) {
  const std::string& arch = config.architecture;
  const char* causal_lm = arch == "qwen3_next"     ? "Qwen3NextForCausalLM"
                          : arch == "qwen3_5_text" ? "Qwen3_5ForCausalLM"
                                                   : "Qwen3_5MoeForCausalLM";
  nlohmann::ordered_json out;
  if (!config.conditional) out["architectures"] = {causal_lm};
  out["model_type"] = config.architecture;
  out["hidden_act"] = "silu";
  for (auto [field, value] : {std::pair<const char*, int64_t>{"vocab_size", config.vocab_size},
                              {"hidden_size", config.hidden_size},
                              {"num_hidden_layers", config.num_layers},
                              {"num_attention_heads", config.num_heads},
                              {"num_key_value_heads", config.num_kv_heads},
                              {"head_dim", config.head_dim},
                              {"max_position_embeddings", config.max_position_embeddings},
                              {"linear_conv_kernel_dim", config.linear.conv_kernel},
                              {"linear_key_head_dim", config.linear.key_head_dim},
                              {"linear_value_head_dim", config.linear.value_head_dim},
                              {"linear_num_key_heads", config.linear.key_heads},
                              {"linear_num_value_heads", config.linear.value_heads}})
    out[field] = value;
  if (config.intermediate_size > 0) out["intermediate_size"] = config.intermediate_size;  // none: experts only
  out["rms_norm_eps"] = config.rms_norm_eps;
  out["attention_bias"] = config.attention_bias;
  out["tie_word_embeddings"] = config.tie_word_embeddings;
  nlohmann::ordered_json& types = out["layer_types"] = nlohmann::ordered_json::array();
  for (int64_t l = 0; l < config.num_layers; ++l)
    types.push_back(config.is_linear(l) ? "linear_attention" : "full_attention");
  AddMoeJson(config, out);
  nlohmann::ordered_json& rope = out["rope_parameters"];
  rope["rope_type"] = config.rope_scaling.type;
  rope["rope_theta"] = config.rope_theta;
  rope["partial_rotary_factor"] = config.partial_rotary_factor;
  return out;
}

}  // namespace

std::string TransformerConfigToHFJson(const TransformerConfig& config) {
  if (config.mamba_family()) return Mamba2FamilyConfigToHFJson(config);
  if (config.hybrid()) {
    nlohmann::ordered_json out = HybridTextJson(config);
    if (config.conditional) {
      nlohmann::ordered_json outer;
      const bool moe = config.architecture == "qwen3_5_moe_text";
      outer["architectures"] = {moe ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5ForConditionalGeneration"};
      outer["model_type"] = moe ? "qwen3_5_moe" : "qwen3_5";
      outer["tie_word_embeddings"] = config.tie_word_embeddings;
      outer["text_config"] = std::move(out);
      out = std::move(outer);
    }
    return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  }
  const bool is_qwen2 = config.architecture == "qwen2", is_llama = config.architecture == "llama";
  const std::string& arch = config.architecture;
  nlohmann::ordered_json out;
  out["architectures"] = {is_qwen2              ? "Qwen2ForCausalLM"
                          : is_llama            ? "LlamaForCausalLM"
                          : arch == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                          : arch == "mixtral"   ? "MixtralForCausalLM"
                                                : "Qwen3ForCausalLM"};
  out["model_type"] = config.architecture;
  out["torch_dtype"] = "float32";
  out["hidden_act"] = "silu";
  out["vocab_size"] = config.vocab_size;
  out["hidden_size"] = config.hidden_size;
  out["num_hidden_layers"] = config.num_layers;
  out["num_attention_heads"] = config.num_heads;
  out["num_key_value_heads"] = config.num_kv_heads;
  out["head_dim"] = config.head_dim;
  out["intermediate_size"] = config.intermediate_size;
  out["rms_norm_eps"] = config.rms_norm_eps;
  out["rope_theta"] = config.rope_theta;
  const RopeScaling& rope = config.rope_scaling;
  if (rope.type == "default") {
    out["rope_scaling"] = nullptr;
  } else {
    nlohmann::ordered_json& block = out["rope_scaling"];
    block["rope_type"] = rope.type;
    block["factor"] = rope.factor;
    if (rope.type == "llama3" || rope.type == "yarn")
      block["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    if (rope.type == "llama3") {
      block["low_freq_factor"] = rope.low_freq_factor;
      block["high_freq_factor"] = rope.high_freq_factor;
    }
    if (rope.type == "yarn") {
      if (rope.attention_factor > 0) block["attention_factor"] = rope.attention_factor;
      if (rope.mscale > 0) block["mscale"] = rope.mscale;
      if (rope.mscale_all_dim > 0) block["mscale_all_dim"] = rope.mscale_all_dim;
      block["beta_fast"] = rope.beta_fast;
      block["beta_slow"] = rope.beta_slow;
      block["truncate"] = rope.truncate;
    }
  }
  out["max_position_embeddings"] = config.max_position_embeddings;
  out["tie_word_embeddings"] = config.tie_word_embeddings;
  // Qwen2Config has no such option (its biases are fixed), nor MixtralConfig; only Llama has mlp_bias.
  if (!is_qwen2 && arch != "mixtral") out["attention_bias"] = config.attention_bias;
  if (is_llama) out["mlp_bias"] = config.mlp_bias;
  AddMoeJson(config, out);
  // Replacement keeps dump() from aborting on a non-UTF-8 architecture string.
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

#undef SG_IO_ASSIGN_OR_RETURN

}  // namespace io
}  // namespace sg
