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

absl::Status CheckSilu(const FieldReader& fields, const char* field) {
  std::optional<std::string> act;
  SG_IO_ASSIGN_OR_RETURN(act, fields.String(field));
  if (act && *act != "silu") return fields.Error(field, absl::StrCat("is '", *act, "'; only 'silu' is supported"));
  return absl::OkStatus();
}

// The mixer's shapes: heads x head_dim must be expand x hidden_size and the heads split evenly into groups.
absl::Status CheckMambaShapes(const FieldReader& fields, const TransformerConfig& c, const char* heads_field,
                              const char* groups_field) {
  const Mamba2Config& m = c.mamba;
  if (m.heads * m.head_dim != m.expand * c.hidden_size)
    return fields.Error(heads_field, absl::StrCat("(", m.heads, ") x head_dim (", m.head_dim, ") must equal expand (",
                                                  m.expand, ") x hidden_size (", c.hidden_size, ")"));
  if (m.heads % m.groups != 0)
    return fields.Error(groups_field,
                        absl::StrCat("(", m.groups, ") must divide the Mamba heads (", m.heads, ")"));
  return absl::OkStatus();
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
  c.mixers.assign(c.num_layers, Mixer::kMamba2);
  c.mlps.assign(c.num_layers, Mlp::kNone);
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

}  // namespace

absl::StatusOr<TransformerConfig> ParseMamba2FamilyConfig(const FieldReader& fields, const std::string& architecture) {
  if (architecture == "mamba2") return ParseMamba2(fields);
  return fields.Error("model_type", absl::StrCat("'", architecture, "' is not a Mamba-2 model"));
}

std::string Mamba2FamilyConfigToHFJson(const TransformerConfig& c) {
  nlohmann::ordered_json out = Mamba2Json(c);
  out["torch_dtype"] = "float32";
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace sg::io
