// config.json <-> TransformerConfig for Mamba-2 and its hybrids (mamba2, bamba, nemotron_h, falcon_h1), with
// transformers 5.23's defaults; what the engine does not implement is refused by field.
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/io/config_fields.h"
#include "core/models/transformer/config.h"
#include "nlohmann/json.hpp"

namespace sg::io {
namespace {

using internal::JsonTypeName;
using nlohmann::json;

// transformers writes an infinite float as {"__float__": "Infinity"} (JSON has no literal for it).
std::optional<double> JsonFloat(const json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_object() && v.size() == 1 && v.contains("__float__") && v["__float__"].is_string()) {
    const std::string& s = v["__float__"].get_ref<const std::string&>();
    if (s == "Infinity" || s == "inf") return std::numeric_limits<double>::infinity();
  }
  return std::nullopt;
}

nlohmann::ordered_json FloatJson(double x) {
  if (std::isinf(x) && x > 0) return nlohmann::ordered_json{{"__float__", "Infinity"}};
  return x;
}

// time_step_limit [dt_min, dt_max]: the clamp of dt after its softplus.
absl::Status ParseTimeStepLimit(const FieldReader& fields, Mamba2Config& m) {
  const json* limit = fields.Get("time_step_limit");
  if (limit == nullptr) return absl::OkStatus();
  std::optional<double> lo, hi;
  if (limit->is_array() && limit->size() == 2) lo = JsonFloat((*limit)[0]), hi = JsonFloat((*limit)[1]);
  if (!lo || !hi || !(*lo >= 0) || !(*hi >= *lo) || std::isnan(*hi))
    return fields.Error("time_step_limit", "must be [min, max] with 0 <= min <= max (max may be Infinity)");
  m.dt_min = *lo, m.dt_max = *hi;
  return absl::OkStatus();
}

// A flag per layer: past this many layers (real models have a few hundred at most) a config is refused before the
// lists are made.
absl::Status CheckLayerCount(const FieldReader& fields, int64_t layers) {
  if (layers <= (int64_t{1} << 16)) return absl::OkStatus();
  return fields.Error("num_hidden_layers", absl::StrCat("is ", layers, "; supported up to 65536 layers"));
}

absl::Status CheckSilu(const FieldReader& fields, const char* field) {
  std::optional<std::string> act;
  SG_IO_ASSIGN_OR_RETURN(act, fields.String(field));
  if (act && *act != "silu") return fields.Error(field, absl::StrCat("is '", *act, "'; only 'silu' is supported"));
  return absl::OkStatus();
}

// The mixer's shapes: heads x head_dim must be the mixer's width (expand x hidden_size; Falcon-H1's mamba_d_ssm) and
// the heads split evenly into groups.
absl::Status CheckMambaShapes(const FieldReader& fields, const Mamba2Config& m, int64_t width,
                              const std::string& width_is, const char* heads_field, const char* groups_field) {
  if (m.heads * m.head_dim != width)
    return fields.Error(heads_field,
                        absl::StrCat("(", m.heads, ") x head_dim (", m.head_dim, ") must equal ", width_is));
  if (m.heads % m.groups != 0)
    return fields.Error(groups_field, absl::StrCat("(", m.groups, ") must divide the Mamba heads (", m.heads, ")"));
  return absl::OkStatus();
}
absl::Status CheckMambaShapes(const FieldReader& fields, const TransformerConfig& c, const char* heads_field,
                              const char* groups_field) {
  const Mamba2Config& m = c.mamba;
  return CheckMambaShapes(fields, m, m.expand * c.hidden_size,
                          absl::StrCat("expand (", m.expand, ") x hidden_size (", c.hidden_size, ")"), heads_field,
                          groups_field);
}

// transformers' Mamba2ForCausalLM: Mamba-2 mixers only, each after an RMSNorm, no MLP.
absl::StatusOr<TransformerConfig> ParseMamba2(const FieldReader& fields) {
  TransformerConfig c;
  c.architecture = "mamba2";
  Mamba2Config& m = c.mamba;
  SG_IO_ASSIGN_OR_RETURN(c.vocab_size, fields.PositiveInt("vocab_size"));
  SG_IO_ASSIGN_OR_RETURN(c.hidden_size, fields.PositiveInt("hidden_size"));
  SG_IO_ASSIGN_OR_RETURN(c.num_layers, fields.PositiveInt("num_hidden_layers"));
  SG_IO_ASSIGN_OR_RETURN(m.heads, fields.PositiveInt("num_heads", 128));
  SG_IO_ASSIGN_OR_RETURN(m.head_dim, fields.PositiveInt("head_dim", 64));
  SG_IO_ASSIGN_OR_RETURN(m.state, fields.PositiveInt("state_size", 128));
  SG_IO_ASSIGN_OR_RETURN(m.groups, fields.PositiveInt("n_groups", 8));
  SG_IO_ASSIGN_OR_RETURN(m.conv_kernel, fields.PositiveInt("conv_kernel", 4));
  SG_IO_ASSIGN_OR_RETURN(m.expand, fields.PositiveInt("expand", 2));
  SG_IO_ASSIGN_OR_RETURN(m.chunk_size, fields.PositiveInt("chunk_size", 256));
  SG_IO_ASSIGN_OR_RETURN(m.proj_bias, fields.Bool("use_bias", false));
  SG_IO_ASSIGN_OR_RETURN(m.conv_bias, fields.Bool("use_conv_bias", true));
  SG_IO_ASSIGN_OR_RETURN(c.rms_norm_eps, fields.PositiveNumber("layer_norm_epsilon", 1e-5));
  m.norm_eps = c.rms_norm_eps;
  SG_IO_ASSIGN_OR_RETURN(c.tie_word_embeddings, fields.Bool("tie_word_embeddings", false));
  if (absl::Status s = CheckSilu(fields, "hidden_act"); !s.ok()) return s;
  if (absl::Status s = ParseTimeStepLimit(fields, m); !s.ok()) return s;
  if (absl::Status s = CheckMambaShapes(fields, c, "num_heads", "n_groups"); !s.ok()) return s;
  if (absl::Status s = CheckLayerCount(fields, c.num_layers); !s.ok()) return s;
  c.mixers.assign(c.num_layers, Mixer::kMamba2);
  c.mlps.assign(c.num_layers, Mlp::kNone);
  return c;
}

// The attention of a hybrid: heads, KV heads and head_dim (hidden_size / heads unless given).
absl::Status ParseAttention(const FieldReader& fields, TransformerConfig& c, int64_t heads, int64_t kv_heads,
                            std::optional<int64_t> head_dim) {
  SG_IO_ASSIGN_OR_RETURN(c.num_heads, fields.PositiveInt("num_attention_heads", heads));
  SG_IO_ASSIGN_OR_RETURN(c.num_kv_heads, fields.PositiveInt("num_key_value_heads", kv_heads));
  if (c.num_heads % c.num_kv_heads != 0)
    return fields.Error("num_key_value_heads",
                        absl::StrCat("(", c.num_kv_heads, ") must divide num_attention_heads (", c.num_heads, ")"));
  SG_IO_ASSIGN_OR_RETURN(c.head_dim, fields.PositiveInt("head_dim", head_dim.value_or(c.hidden_size / c.num_heads)));
  return absl::OkStatus();
}

// A field that must be absent, or this value (what the engine implements).
absl::Status RequireNumber(const FieldReader& fields, const char* field, double want, const char* why) {
  const json* v = fields.Get(field);
  if (v == nullptr || (v->is_number() && v->get<double>() == want)) return absl::OkStatus();
  return fields.Error(field, absl::StrCat("is ", v->dump(), "; ", why, " (", want, ")"));
}

// Bamba's mamba_* fields; Falcon-H1's too, whose mixer is mamba_d_ssm wide (null: mamba_expand x hidden_size).
absl::Status ParseMambaFields(const FieldReader& fields, TransformerConfig& c, bool falcon = false) {
  Mamba2Config& m = c.mamba;
  SG_IO_ASSIGN_OR_RETURN(m.heads, fields.PositiveInt("mamba_n_heads", 128));
  SG_IO_ASSIGN_OR_RETURN(m.groups, fields.PositiveInt("mamba_n_groups", 1));
  SG_IO_ASSIGN_OR_RETURN(m.state, fields.PositiveInt("mamba_d_state", 256));
  SG_IO_ASSIGN_OR_RETURN(m.conv_kernel, fields.PositiveInt("mamba_d_conv", 4));
  SG_IO_ASSIGN_OR_RETURN(m.expand, fields.PositiveInt("mamba_expand", 2));
  SG_IO_ASSIGN_OR_RETURN(m.chunk_size, fields.PositiveInt("mamba_chunk_size", 256));
  SG_IO_ASSIGN_OR_RETURN(m.conv_bias, fields.Bool("mamba_conv_bias", true));
  SG_IO_ASSIGN_OR_RETURN(m.proj_bias, fields.Bool("mamba_proj_bias", false));
  int64_t width = m.expand * c.hidden_size;
  std::string width_is = absl::StrCat("mamba_expand (", m.expand, ") x hidden_size (", c.hidden_size, ")");
  if (falcon && !(fields.Has("mamba_d_ssm") && !fields.Get("mamba_d_ssm"))) {
    SG_IO_ASSIGN_OR_RETURN(width, fields.PositiveInt("mamba_d_ssm", 1024));  // FalconH1Config's default
    width_is = absl::StrCat("mamba_d_ssm (", width, ")");
  }
  // mamba_d_head "auto" (or absent): the width / heads.
  const json* d_head = fields.Get("mamba_d_head");
  if (d_head && d_head->is_string() && d_head->get_ref<const std::string&>() == "auto") d_head = nullptr;
  if (d_head == nullptr) {
    m.head_dim = width / m.heads;
  } else {
    SG_IO_ASSIGN_OR_RETURN(m.head_dim, fields.PositiveInt("mamba_d_head"));
  }
  m.norm_eps = c.rms_norm_eps;
  if (absl::Status s = ParseTimeStepLimit(fields, m); !s.ok()) return s;
  return CheckMambaShapes(fields, m, width, width_is, "mamba_n_heads", "mamba_n_groups");
}

// nn.Embedding's padding_idx: pad_token_id (absent: the config class's 0; null: none).
absl::Status ParsePadToken(const FieldReader& fields, TransformerConfig& c) {
  const json* pad = fields.Get("pad_token_id");
  c.pad_token_id = fields.Has("pad_token_id") && !pad ? -1 : 0;
  if (pad) {
    if (!pad->is_number_integer() || pad->get<int64_t>() < 0 || pad->get<int64_t>() >= c.vocab_size)
      return fields.Error("pad_token_id", absl::StrCat("is ", pad->dump(), "; it must be a token id or null"));
    c.pad_token_id = pad->get<int64_t>();
  }
  return absl::OkStatus();
}

// The fields Bamba and Falcon-H1 share: sizes, attention, the SwiGLU MLP.
absl::Status ParseHybridFields(const FieldReader& fields, TransformerConfig& c, int64_t max_positions) {
  SG_IO_ASSIGN_OR_RETURN(c.vocab_size, fields.PositiveInt("vocab_size"));
  SG_IO_ASSIGN_OR_RETURN(c.hidden_size, fields.PositiveInt("hidden_size"));
  SG_IO_ASSIGN_OR_RETURN(c.num_layers, fields.PositiveInt("num_hidden_layers"));
  SG_IO_ASSIGN_OR_RETURN(c.intermediate_size, fields.PositiveInt("intermediate_size", 14336));
  SG_IO_ASSIGN_OR_RETURN(c.rms_norm_eps, fields.PositiveNumber("rms_norm_eps", 1e-5));
  SG_IO_ASSIGN_OR_RETURN(c.max_position_embeddings, fields.PositiveInt("max_position_embeddings", max_positions));
  SG_IO_ASSIGN_OR_RETURN(c.tie_word_embeddings, fields.Bool("tie_word_embeddings", false));
  SG_IO_ASSIGN_OR_RETURN(c.attention_bias, fields.Bool("attention_bias", false));
  SG_IO_ASSIGN_OR_RETURN(c.mlp_bias, fields.Bool("mlp_bias", false));
  if (absl::Status s = ParseAttention(fields, c, 32, 8, std::nullopt); !s.ok()) return s;
  if (absl::Status s = CheckSilu(fields, "hidden_act"); !s.ok()) return s;
  return absl::OkStatus();
}

// transformers' BambaForCausalLM: Mamba-2 layers and attention layers (attn_layer_indices; RoPE on half of each
// head), each followed by a SwiGLU MLP.
absl::StatusOr<TransformerConfig> ParseBamba(const FieldReader& fields, const std::string& source_name) {
  TransformerConfig c;
  c.architecture = "bamba";
  if (absl::Status s = ParseHybridFields(fields, c, 262144); !s.ok()) return s;
  if (absl::Status s = RequireNumber(fields, "z_loss_coefficient", 0, "the z-loss is not supported"); !s.ok()) return s;
  if (absl::Status s = ParseMambaFields(fields, c); !s.ok()) return s;
  if (absl::Status s = ParsePadToken(fields, c); !s.ok()) return s;
  c.partial_rotary_factor = 0.5;  // BambaConfig's, unless its RoPE block says otherwise
  if (absl::Status s = ParseTransformerRope(fields, source_name, c); !s.ok()) return s;
  if (absl::Status s = CheckLayerCount(fields, c.num_layers); !s.ok()) return s;
  c.mixers.assign(c.num_layers, Mixer::kMamba2);
  if (const json* indices = fields.Get("attn_layer_indices")) {
    if (!indices->is_array()) return fields.Error("attn_layer_indices", "must be an array of layer indices");
    for (const json& i : *indices) {
      if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= c.num_layers)
        return fields.Error("attn_layer_indices", absl::StrCat("holds ", i.dump(), ", not a layer index"));
      c.mixers[i.get<int64_t>()] = Mixer::kAttention;
    }
  }
  return c;
}

// A list of `size` positive multipliers (FalconH1Config's mlp_multipliers, ssm_multipliers); absent or null: ones.
absl::StatusOr<std::vector<double>> Multipliers(const FieldReader& fields, const char* field, size_t size) {
  std::vector<double> out(size, 1.0);
  const json* list = fields.Get(field);
  if (list == nullptr) return out;
  if (!list->is_array() || list->size() != size)
    return fields.Error(field, absl::StrCat("must be a list of ", size, " numbers"));
  for (size_t i = 0; i < size; ++i) {
    const json& v = (*list)[i];
    if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
      return fields.Error(field, absl::StrCat("holds ", v.dump(), "; the multipliers must be positive and finite"));
    out[i] = v.get<double>();
  }
  return out;
}

// FalconH1Config's muP multipliers.
absl::Status ParseMupMultipliers(const FieldReader& fields, MupMultipliers& mup) {
  for (auto [field, value] : {std::pair<const char*, double*>{"embedding_multiplier", &mup.embedding},
                              {"lm_head_multiplier", &mup.lm_head},
                              {"attention_in_multiplier", &mup.attention_in},
                              {"key_multiplier", &mup.key},
                              {"attention_out_multiplier", &mup.attention_out},
                              {"ssm_in_multiplier", &mup.ssm_in},
                              {"ssm_out_multiplier", &mup.ssm_out}})
    SG_IO_ASSIGN_OR_RETURN(*value, fields.PositiveNumber(field, 1.0));
  SG_IO_ASSIGN_OR_RETURN(mup.ssm, Multipliers(fields, "ssm_multipliers", 5));
  std::vector<double> mlp;
  SG_IO_ASSIGN_OR_RETURN(mlp, Multipliers(fields, "mlp_multipliers", 2));
  mup.mlp_gate = mlp[0], mup.mlp_down = mlp[1];
  return absl::OkStatus();
}

// transformers' FalconH1ForCausalLM: in every layer attention and a Mamba-2 mixer side by side on the normed input,
// their outputs summed, then a SwiGLU MLP; muP multipliers throughout.
absl::StatusOr<TransformerConfig> ParseFalconH1(const FieldReader& fields, const std::string& source_name) {
  TransformerConfig c;
  c.architecture = "falcon_h1";
  if (absl::Status s = ParseHybridFields(fields, c, 8192); !s.ok()) return s;
  if (absl::Status s = ParseMambaFields(fields, c, /*falcon=*/true); !s.ok()) return s;
  SG_IO_ASSIGN_OR_RETURN(c.mamba.gated_norm, fields.Bool("mamba_rms_norm", false));
  bool norm_before_gate, projectors_bias, use_mlp;
  SG_IO_ASSIGN_OR_RETURN(norm_before_gate, fields.Bool("mamba_norm_before_gate", true));
  if (c.mamba.gated_norm && norm_before_gate)
    return fields.Error("mamba_norm_before_gate",
                        "is true with mamba_rms_norm; the gated norm is supported after the gate (false)");
  // The published models have no projection biases: without them every multiplier scales a projection's output.
  if (c.attention_bias) return fields.Error("attention_bias", "is true; Falcon-H1 is supported without (false)");
  if (c.mamba.proj_bias) return fields.Error("mamba_proj_bias", "is true; Falcon-H1 is supported without (false)");
  SG_IO_ASSIGN_OR_RETURN(projectors_bias, fields.Bool("projectors_bias", false));
  if (projectors_bias)
    return fields.Error("projectors_bias", "is true; the Mamba out_proj bias apart from in_proj's is not supported");
  SG_IO_ASSIGN_OR_RETURN(use_mlp, fields.Bool("mamba_use_mlp", true));
  if (!use_mlp)
    return fields.Error("mamba_use_mlp", "is false; transformers 5.23 builds every layer's MLP whatever it says");
  if (absl::Status s = ParseMupMultipliers(fields, c.mup); !s.ok()) return s;
  if (absl::Status s = ParsePadToken(fields, c); !s.ok()) return s;
  if (absl::Status s = ParseTransformerRope(fields, source_name, c); !s.ok()) return s;
  if (absl::Status s = CheckLayerCount(fields, c.num_layers); !s.ok()) return s;
  c.mixers.assign(c.num_layers, Mixer::kAttentionMamba2);
  return c;
}

// Nemotron-H's layer kinds (layers_block_type, or the older hybrid_override_pattern: M, *, -, E).
absl::Status ParseNemotronLayers(const FieldReader& fields, TransformerConfig& c) {
  std::vector<std::string> kinds;
  const char* field = fields.Get("layers_block_type") ? "layers_block_type" : "hybrid_override_pattern";
  const json* list = fields.Get(field);
  if (list == nullptr) {
    kinds = {"linear_attention", "moe", "full_attention", "mlp"};  // NemotronHConfig's default
  } else if (list->is_string()) {
    for (char k : list->get_ref<const std::string&>())
      kinds.push_back(k == 'M'   ? "linear_attention"
                      : k == '*' ? "full_attention"
                      : k == '-' ? "mlp"
                      : k == 'E' ? "moe"
                                 : std::string(1, k));
  } else if (list->is_array()) {
    for (const json& k : *list) kinds.push_back(k.is_string() ? k.get<std::string>() : k.dump());
  } else {
    return fields.Error(field, absl::StrCat("must be a list of layer kinds, got ", JsonTypeName(*list)));
  }
  if (kinds.empty() || kinds.size() > (size_t{1} << 16))
    return fields.Error(field, absl::StrCat("lists ", kinds.size(), " layers; 1 to 65536 are supported"));
  for (const std::string& k : kinds) {
    if (k == "linear_attention" || k == "M") {
      c.mixers.push_back(Mixer::kMamba2), c.mlps.push_back(Mlp::kNone);
    } else if (k == "full_attention" || k == "attention") {
      c.mixers.push_back(Mixer::kAttention), c.mlps.push_back(Mlp::kNone);
    } else if (k == "mlp") {
      c.mixers.push_back(Mixer::kNone), c.mlps.push_back(Mlp::kRelu2);
    } else {
      return fields.Error(field, absl::StrCat("has '", k, "'; ",
                                              k == "moe" ? "Nemotron-H's mixture-of-experts layers are not supported"
                                                         : "the kinds are linear_attention, full_attention, mlp"));
    }
  }
  c.num_layers = static_cast<int64_t>(kinds.size());
  return absl::OkStatus();
}

// transformers' NemotronHForCausalLM: one block per layer, Mamba-2, attention without RoPE, or a ReLU² MLP.
absl::StatusOr<TransformerConfig> ParseNemotronH(const FieldReader& fields) {
  TransformerConfig c;
  c.architecture = "nemotron_h";
  c.rope = false;
  Mamba2Config& m = c.mamba;
  SG_IO_ASSIGN_OR_RETURN(c.vocab_size, fields.PositiveInt("vocab_size"));
  SG_IO_ASSIGN_OR_RETURN(c.hidden_size, fields.PositiveInt("hidden_size"));
  if (absl::Status s = ParseNemotronLayers(fields, c); !s.ok()) return s;
  SG_IO_ASSIGN_OR_RETURN(c.intermediate_size, fields.PositiveInt("intermediate_size", 21504));
  SG_IO_ASSIGN_OR_RETURN(c.rms_norm_eps, fields.PositiveNumber("layer_norm_epsilon", 1e-5));
  SG_IO_ASSIGN_OR_RETURN(c.max_position_embeddings, fields.PositiveInt("max_position_embeddings", 4096));
  bool tied;
  SG_IO_ASSIGN_OR_RETURN(tied, fields.Bool("tie_word_embeddings", false));
  if (tied)
    return fields.Error("tie_word_embeddings",
                        "is true; transformers 5.23's NemotronHForCausalLM does not tie the "
                        "head to the embedding (false)");
  SG_IO_ASSIGN_OR_RETURN(c.mlp_bias, fields.Bool("mlp_bias", false));
  if (absl::Status s = ParseAttention(fields, c, 32, 8, 128); !s.ok()) return s;
  SG_IO_ASSIGN_OR_RETURN(m.heads, fields.PositiveInt("mamba_num_heads", 128));
  SG_IO_ASSIGN_OR_RETURN(m.head_dim, fields.PositiveInt("mamba_head_dim", 64));
  SG_IO_ASSIGN_OR_RETURN(m.state, fields.PositiveInt("ssm_state_size", 128));
  SG_IO_ASSIGN_OR_RETURN(m.groups, fields.PositiveInt("n_groups", 8));
  SG_IO_ASSIGN_OR_RETURN(m.conv_kernel, fields.PositiveInt("conv_kernel", 4));
  SG_IO_ASSIGN_OR_RETURN(m.expand, fields.PositiveInt("expand", 2));
  SG_IO_ASSIGN_OR_RETURN(m.chunk_size, fields.PositiveInt("chunk_size", 128));
  SG_IO_ASSIGN_OR_RETURN(m.conv_bias, fields.Bool("use_conv_bias", true));
  SG_IO_ASSIGN_OR_RETURN(m.proj_bias, fields.Bool("use_bias", false));
  m.norm_eps = c.rms_norm_eps;
  // NemotronHMamba2Mixer clamps dt to [time_step_min, inf) (not time_step_limit).
  double dt_min;
  SG_IO_ASSIGN_OR_RETURN(dt_min, fields.PositiveNumber("time_step_min", 0.001));
  m.dt_min = dt_min;
  std::optional<std::string> act;
  SG_IO_ASSIGN_OR_RETURN(act, fields.String("mlp_hidden_act"));
  if (act && *act != "relu2")
    return fields.Error("mlp_hidden_act", absl::StrCat("is '", *act, "'; only 'relu2' is supported"));
  if (absl::Status s = CheckSilu(fields, "mamba_hidden_act"); !s.ok()) return s;
  if (const json* mtp = fields.Get("num_nextn_predict_layers"); mtp && *mtp != 0)
    return fields.Error("num_nextn_predict_layers",
                        absl::StrCat("is ", mtp->dump(), "; multi-token prediction layers are not supported (0)"));
  if (fields.Get("sliding_window"))
    return fields.Error("sliding_window", "is set; sliding-window attention is not supported (null)");
  // in_proj gives mamba_num_heads x mamba_head_dim of z and of x, whatever expand says.
  if (m.heads % m.groups != 0)
    return fields.Error("n_groups", absl::StrCat("(", m.groups, ") must divide mamba_num_heads (", m.heads, ")"));
  return c;
}

nlohmann::ordered_json Mamba2Json(const TransformerConfig& c) {
  const Mamba2Config& m = c.mamba;
  nlohmann::ordered_json out;
  out["architectures"] = {"Mamba2ForCausalLM"};
  out["model_type"] = "mamba2";
  out["hidden_act"] = "silu";
  for (auto [field, value] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                              {"hidden_size", c.hidden_size},
                              {"num_hidden_layers", c.num_layers},
                              {"num_heads", m.heads},
                              {"head_dim", m.head_dim},
                              {"state_size", m.state},
                              {"n_groups", m.groups},
                              {"conv_kernel", m.conv_kernel},
                              {"expand", m.expand},
                              {"chunk_size", m.chunk_size}})
    out[field] = value;
  out["use_bias"] = m.proj_bias;
  out["use_conv_bias"] = m.conv_bias;
  out["layer_norm_epsilon"] = c.rms_norm_eps;
  out["time_step_limit"] = {FloatJson(m.dt_min), FloatJson(m.dt_max)};
  out["tie_word_embeddings"] = c.tie_word_embeddings;
  return out;
}

// Fields that Bamba and Nemotron-H write alike.
void AddCommonJson(const TransformerConfig& c, nlohmann::ordered_json& out) {
  for (auto [field, value] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                              {"hidden_size", c.hidden_size},
                              {"num_hidden_layers", c.num_layers},
                              {"intermediate_size", c.intermediate_size},
                              {"num_attention_heads", c.num_heads},
                              {"num_key_value_heads", c.num_kv_heads},
                              {"head_dim", c.head_dim},
                              {"max_position_embeddings", c.max_position_embeddings}})
    out[field] = value;
  out["mlp_bias"] = c.mlp_bias;
  out["tie_word_embeddings"] = c.tie_word_embeddings;
}

// Bamba's and Falcon-H1's mamba_* fields, padding row and RoPE.
void AddMambaJson(const TransformerConfig& c, nlohmann::ordered_json& out) {
  const Mamba2Config& m = c.mamba;
  for (auto [field, value] : {std::pair<const char*, int64_t>{"mamba_n_heads", m.heads},
                              {"mamba_d_head", m.head_dim},
                              {"mamba_n_groups", m.groups},
                              {"mamba_d_state", m.state},
                              {"mamba_d_conv", m.conv_kernel},
                              {"mamba_expand", m.expand},
                              {"mamba_chunk_size", m.chunk_size}})
    out[field] = value;
  out["mamba_conv_bias"] = m.conv_bias;
  out["mamba_proj_bias"] = m.proj_bias;
  out["time_step_limit"] = {FloatJson(m.dt_min), FloatJson(m.dt_max)};
  out["pad_token_id"] = c.pad_token_id >= 0 ? nlohmann::ordered_json(c.pad_token_id) : nlohmann::ordered_json();
  nlohmann::ordered_json& rope = out["rope_parameters"];
  rope["rope_type"] = "default";
  rope["rope_theta"] = c.rope_theta;
  if (c.architecture == "bamba") rope["partial_rotary_factor"] = c.partial_rotary_factor;
}

nlohmann::ordered_json BambaJson(const TransformerConfig& c) {
  nlohmann::ordered_json out;
  out["architectures"] = {"BambaForCausalLM"};
  out["model_type"] = "bamba";
  out["hidden_act"] = "silu";
  AddCommonJson(c, out);
  out["rms_norm_eps"] = c.rms_norm_eps;
  out["attention_bias"] = c.attention_bias;
  nlohmann::ordered_json& attention = out["attn_layer_indices"] = nlohmann::ordered_json::array();
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.mixer(l) == Mixer::kAttention) attention.push_back(l);
  AddMambaJson(c, out);
  out["z_loss_coefficient"] = 0.0;
  return out;
}

nlohmann::ordered_json FalconH1Json(const TransformerConfig& c) {
  const MupMultipliers& mup = c.mup;
  nlohmann::ordered_json out;
  out["architectures"] = {"FalconH1ForCausalLM"};
  out["model_type"] = "falcon_h1";
  out["hidden_act"] = "silu";
  AddCommonJson(c, out);
  out["rms_norm_eps"] = c.rms_norm_eps;
  out["attention_bias"] = c.attention_bias;
  AddMambaJson(c, out);
  out["mamba_d_ssm"] = c.mamba.intermediate();
  out["mamba_rms_norm"] = c.mamba.gated_norm;
  out["mamba_norm_before_gate"] = false;
  out["projectors_bias"] = false;
  for (auto [field, value] : {std::pair<const char*, double>{"embedding_multiplier", mup.embedding},
                              {"lm_head_multiplier", mup.lm_head},
                              {"attention_in_multiplier", mup.attention_in},
                              {"key_multiplier", mup.key},
                              {"attention_out_multiplier", mup.attention_out},
                              {"ssm_in_multiplier", mup.ssm_in},
                              {"ssm_out_multiplier", mup.ssm_out}})
    out[field] = value;
  out["ssm_multipliers"] = mup.ssm;
  out["mlp_multipliers"] = {mup.mlp_gate, mup.mlp_down};
  return out;
}

nlohmann::ordered_json NemotronHJson(const TransformerConfig& c) {
  const Mamba2Config& m = c.mamba;
  nlohmann::ordered_json out;
  out["architectures"] = {"NemotronHForCausalLM"};
  out["model_type"] = "nemotron_h";
  AddCommonJson(c, out);
  out.erase("num_hidden_layers");  // the length of layers_block_type
  nlohmann::ordered_json& kinds = out["layers_block_type"] = nlohmann::ordered_json::array();
  for (int64_t l = 0; l < c.num_layers; ++l)
    kinds.push_back(c.mixer(l) == Mixer::kMamba2      ? "linear_attention"
                    : c.mixer(l) == Mixer::kAttention ? "full_attention"
                                                      : "mlp");
  out["layer_norm_epsilon"] = c.rms_norm_eps;
  out["mlp_hidden_act"] = "relu2";
  out["mamba_hidden_act"] = "silu";
  for (auto [field, value] : {std::pair<const char*, int64_t>{"mamba_num_heads", m.heads},
                              {"mamba_head_dim", m.head_dim},
                              {"ssm_state_size", m.state},
                              {"n_groups", m.groups},
                              {"conv_kernel", m.conv_kernel},
                              {"expand", m.expand},
                              {"chunk_size", m.chunk_size}})
    out[field] = value;
  out["use_conv_bias"] = m.conv_bias;
  out["use_bias"] = m.proj_bias;
  out["time_step_min"] = m.dt_min;
  out["num_nextn_predict_layers"] = 0;
  return out;
}

}  // namespace

absl::StatusOr<TransformerConfig> ParseMamba2FamilyConfig(const FieldReader& fields, const std::string& source_name,
                                                          const std::string& architecture) {
  if (architecture == "mamba2") return ParseMamba2(fields);
  if (architecture == "bamba") return ParseBamba(fields, source_name);
  if (architecture == "nemotron_h") return ParseNemotronH(fields);
  if (architecture == "falcon_h1") return ParseFalconH1(fields, source_name);
  return fields.Error("model_type", absl::StrCat("'", architecture, "' is not a Mamba-2 model"));
}

std::string Mamba2FamilyConfigToHFJson(const TransformerConfig& c) {
  nlohmann::ordered_json out = c.architecture == "bamba"        ? BambaJson(c)
                               : c.architecture == "nemotron_h" ? NemotronHJson(c)
                               : c.architecture == "falcon_h1"  ? FalconH1Json(c)
                                                                : Mamba2Json(c);
  out["torch_dtype"] = "float32";
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace sg::io
