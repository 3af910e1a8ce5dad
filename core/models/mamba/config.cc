#include "core/models/mamba/config.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "core/io/config_fields.h"
#include "nlohmann/json.hpp"

namespace sg {

absl::StatusOr<ModelFootprint> Footprint(const MambaConfig& c, DType dtype) {
  if (absl::Status s = CheckConfigBounds({{"vocab_size", c.vocab_size, INT32_MAX},
                                          {"hidden_size", c.hidden_size, INT64_MAX},
                                          {"state_size", c.state_size, INT64_MAX},
                                          {"num_hidden_layers", c.num_layers, INT32_MAX},
                                          {"intermediate_size", c.intermediate_size, INT64_MAX},
                                          {"conv_kernel", c.conv_kernel, INT32_MAX},
                                          {"time_step_rank", c.time_step_rank, INT64_MAX}});
      !s.ok())
    return s;
  FootprintCounter n(dtype);
  const int64_t d = c.hidden_size, E = c.intermediate_size, N = c.state_size, R = c.time_step_rank, L = c.num_layers;
  n.Add(n.Product({{"vocab_size", c.vocab_size}, {"hidden_size", d}}), c.tie_word_embeddings ? 1 : 2);
  n.Add(d, L + 1);                                                                // norms
  n.Add(n.Product({{"2", 2}, {"intermediate_size", E}, {"hidden_size", d}}), L);  // in_proj
  n.Add(n.Product({{"intermediate_size", E}, {"conv_kernel", c.conv_kernel}}), L);
  n.Add(n.Product({{"time_step_rank + 2 x state_size",
                    n.Sum("time_step_rank + 2 x state_size", R, n.Product({{"2", 2}, {"state_size", N}}))},
                   {"intermediate_size", E}}),
        L);                                                                // x_proj
  n.Add(n.Product({{"intermediate_size", E}, {"time_step_rank", R}}), L);  // dt_proj
  n.Add(n.Product({{"intermediate_size", E}, {"state_size", N}}), L);      // A_log
  n.Add(n.Product({{"hidden_size", d}, {"intermediate_size", E}}), L);     // out_proj
  n.Add(E, 4 * L);  // D, dt and conv biases, in_proj bias (upper bound)
  // The scan state of one layer (held per sequence) and the widest per-token row, so that the first step's
  // allocations cannot overflow either.
  n.Product({{"intermediate_size", E}, {"state_size", N}, {"conv_kernel", c.conv_kernel}});
  return n.Result();
}

namespace io {

using nlohmann::json;

absl::StatusOr<MambaConfig> ParseMambaConfig(const std::string& json_text, const std::string& source_name) {
  absl::StatusOr<json> parsed = ParseConfigObject(json_text, source_name);
  if (!parsed.ok()) return parsed.status();
  const FieldReader fields(*parsed, source_name);
  std::optional<std::string> model_type;
  SG_IO_ASSIGN_OR_RETURN(model_type, fields.String("model_type"));
  if (model_type && *model_type != "mamba")
    return fields.Error("model_type", absl::StrCat("is '", *model_type, "'; only 'mamba' (Mamba-1) is supported"));
  MambaConfig config;
  SG_IO_ASSIGN_OR_RETURN(config.vocab_size, fields.PositiveInt("vocab_size"));
  SG_IO_ASSIGN_OR_RETURN(config.hidden_size, fields.PositiveInt("hidden_size"));
  SG_IO_ASSIGN_OR_RETURN(config.state_size, fields.PositiveInt("state_size", 16));
  SG_IO_ASSIGN_OR_RETURN(config.num_layers, fields.PositiveInt("num_hidden_layers"));
  SG_IO_ASSIGN_OR_RETURN(config.conv_kernel, fields.PositiveInt("conv_kernel", 4));
  int64_t expand;
  SG_IO_ASSIGN_OR_RETURN(expand, fields.PositiveInt("expand", 2));
  if (__builtin_mul_overflow(expand, config.hidden_size, &config.intermediate_size))
    return fields.Error("expand",
                        absl::StrCat("(", expand, ") x hidden_size (", config.hidden_size, ") overflows int64"));
  int64_t intermediate;
  SG_IO_ASSIGN_OR_RETURN(intermediate, fields.PositiveInt("intermediate_size", config.intermediate_size));
  if (intermediate != config.intermediate_size)
    return fields.Error("intermediate_size",
                        absl::StrCat("is ", intermediate, " but expand * hidden_size is ", config.intermediate_size));
  const json* rank = fields.Get("time_step_rank");
  if (rank == nullptr || (rank->is_string() && *rank == "auto")) {
    config.time_step_rank = config.hidden_size / 16 + (config.hidden_size % 16 != 0);  // ceil, without overflow
  } else {
    SG_IO_ASSIGN_OR_RETURN(config.time_step_rank, fields.PositiveInt("time_step_rank"));
  }
  SG_IO_ASSIGN_OR_RETURN(config.use_bias, fields.Bool("use_bias", false));
  SG_IO_ASSIGN_OR_RETURN(config.use_conv_bias, fields.Bool("use_conv_bias", true));
  SG_IO_ASSIGN_OR_RETURN(config.layer_norm_epsilon, fields.PositiveNumber("layer_norm_epsilon", 1e-5));
  SG_IO_ASSIGN_OR_RETURN(config.tie_word_embeddings, fields.Bool("tie_word_embeddings", true));
  std::optional<std::string> hidden_act;
  SG_IO_ASSIGN_OR_RETURN(hidden_act, fields.String("hidden_act"));
  if (hidden_act && *hidden_act != "silu")
    return fields.Error("hidden_act", absl::StrCat("is '", *hidden_act, "'; only 'silu' is supported"));
  return config;
}

absl::StatusOr<MambaConfig> LoadMambaConfig(const std::string& path) {
  absl::StatusOr<std::pair<std::string, std::string>> text = ReadConfigJson(path);
  if (!text.ok()) return text.status();
  return ParseMambaConfig(text->first, text->second);
}

std::string MambaConfigToHFJson(const MambaConfig& config) {
  nlohmann::ordered_json out;
  out["architectures"] = {"MambaForCausalLM"};
  out["model_type"] = "mamba";
  out["torch_dtype"] = "float32";
  out["hidden_act"] = "silu";
  out["vocab_size"] = config.vocab_size;
  out["hidden_size"] = config.hidden_size;
  out["state_size"] = config.state_size;
  out["num_hidden_layers"] = config.num_layers;
  out["expand"] = config.intermediate_size / config.hidden_size;
  out["intermediate_size"] = config.intermediate_size;
  out["conv_kernel"] = config.conv_kernel;
  out["time_step_rank"] = config.time_step_rank;
  out["use_bias"] = config.use_bias;
  out["use_conv_bias"] = config.use_conv_bias;
  out["layer_norm_epsilon"] = config.layer_norm_epsilon;
  out["tie_word_embeddings"] = config.tie_word_embeddings;
  out["residual_in_fp32"] = true;
  out["use_cache"] = false;
  return out.dump(2) + "\n";
}

}  // namespace io
}  // namespace sg
