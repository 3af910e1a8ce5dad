#include "core/io/peft.h"

#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/io/json_util.h"
#include "nlohmann/json.hpp"

namespace sg::io {
namespace {

using internal::JsonTypeName;
using nlohmann::json;

// A field that is absent or null counts as absent, as in PEFT's own config classes.
const json* Get(const json& object, const char* field) {
  const auto it = object.find(field);
  return (it == object.end() || it->is_null()) ? nullptr : &*it;
}

}  // namespace

absl::StatusOr<PeftLoraConfig> ParsePeftLoraConfig(const std::string& json_text, const std::string& source) {
  absl::StatusOr<json> parsed = internal::ParseJson(json_text);
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", parsed.status().message()));
  const json& j = *parsed;
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": must be a JSON object, got ", JsonTypeName(j)));
  auto error = [&](const char* field, const std::string& problem) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field '", field, "' ", problem));
  };
  auto unsupported = [&](const char* field, const std::string& problem) {
    return absl::UnimplementedError(absl::StrCat(source, ": field '", field, "' ", problem));
  };
  PeftLoraConfig c;

  const json* type = Get(j, "peft_type");
  if (!type) return error("peft_type", "is missing (a PEFT adapter_config.json has \"peft_type\": \"LORA\")");
  if (!type->is_string()) return error("peft_type", absl::StrCat("must be a string, got ", JsonTypeName(*type)));
  if (type->get<std::string>() != "LORA")
    return unsupported("peft_type", absl::StrCat("is '", type->get<std::string>(), "': only LORA adapters are supported"));

  const json* r = Get(j, "r");
  if (!r) return error("r", "is missing");
  if (!r->is_number_integer() || r->get<int64_t>() <= 0 || r->get<int64_t>() > (int64_t{1} << 20))
    return error("r", absl::StrCat("must be a positive integer, got ", r->is_number() ? r->dump() : JsonTypeName(*r)));
  c.r = r->get<int64_t>();

  const json* alpha = Get(j, "lora_alpha");
  c.lora_alpha = 8;  // PEFT's default
  if (alpha) {
    if (!alpha->is_number() || !(alpha->get<double>() > 0) || !std::isfinite(alpha->get<double>()))
      return error("lora_alpha", absl::StrCat("must be a positive number, got ",
                                              alpha->is_number() ? alpha->dump() : JsonTypeName(*alpha)));
    c.lora_alpha = alpha->get<double>();
  }
  if (const json* dropout = Get(j, "lora_dropout")) {
    if (!dropout->is_number() || !(dropout->get<double>() >= 0 && dropout->get<double>() < 1))
      return error("lora_dropout", absl::StrCat("must be a number in [0, 1), got ",
                                                dropout->is_number() ? dropout->dump() : JsonTypeName(*dropout)));
    c.lora_dropout = dropout->get<double>();
  }

  // target_parameters: parameter names (or paths ending in them) that PEFT adapts directly, e.g. fused experts.
  if (const json* params = Get(j, "target_parameters")) {
    if (!params->is_array())
      return error("target_parameters", absl::StrCat("must be a list of parameter names, got ", JsonTypeName(*params)));
    for (const json& t : *params) {
      if (!t.is_string() || t.get<std::string>().empty())
        return error("target_parameters", absl::StrCat("must hold parameter names (strings), got ", JsonTypeName(t)));
      c.target_parameters.push_back(t.get<std::string>());
    }
  }
  // Parameters alone: target_modules [] or absent (PEFT's way to adapt no module).
  const json* targets = Get(j, "target_modules");
  const bool modules_optional = !c.target_parameters.empty();
  if (!targets) {
    if (!modules_optional) return error("target_modules", "is missing");
  } else if (targets->is_string()) {
    if (!absl::EqualsIgnoreCase(targets->get<std::string>(), "all-linear"))
      return unsupported("target_modules",
                         absl::StrCat("is the regular expression '", targets->get<std::string>(),
                                      "'; only a list of module names (e.g. [\"q_proj\", \"v_proj\"]) or "
                                      "\"all-linear\" is supported"));
    c.all_linear = true;
  } else {
    if (!targets->is_array() || (targets->empty() && !modules_optional))
      return error("target_modules", absl::StrCat("must be a non-empty list of module names, got ",
                                                  targets->is_array() ? "an empty list" : JsonTypeName(*targets)));
    for (const json& t : *targets) {
      if (!t.is_string() || t.get<std::string>().empty())
        return error("target_modules", absl::StrCat("must hold module names (strings), got ", JsonTypeName(t)));
      c.target_modules.push_back(t.get<std::string>());
    }
  }

  // The plain initialisations only draw A and B, which the file carries; the others change or need the base.
  if (const json* init = Get(j, "init_lora_weights")) {
    const bool plain = init->is_boolean() || (init->is_string() && init->get<std::string>() == "gaussian");
    if (!plain)
      return unsupported("init_lora_weights",
                         absl::StrCat("is ", init->dump(), ": only the plain initialisations (true, false, "
                                      "\"gaussian\") are supported; PiSSA, OLoRA, CorDA, LoftQ and the other "
                                      "data- or weight-derived ones change or depend on the base weights, which the "
                                      "adapter file does not carry, so the adapter would compute something else"));
  }
  if (const json* bias = Get(j, "bias")) {
    if (!bias->is_string()) return error("bias", absl::StrCat("must be a string, got ", JsonTypeName(*bias)));
    if (bias->get<std::string>() != "none")
      return unsupported("bias", absl::StrCat("is '", bias->get<std::string>(),
                                              "': only \"none\" (no trained biases) is supported"));
  }
  for (const char* flag : {"fan_in_fan_out", "use_dora", "use_rslora", "lora_bias", "use_qalora"}) {
    const json* v = Get(j, flag);
    if (!v) continue;
    if (!v->is_boolean()) return error(flag, absl::StrCat("must be a boolean, got ", JsonTypeName(*v)));
    if (v->get<bool>()) return unsupported(flag, "is true, which is not supported");
  }
  for (const char* pattern : {"rank_pattern", "alpha_pattern"}) {
    const json* v = Get(j, pattern);
    if (v && !(v->is_object() && v->empty()))
      return unsupported(pattern, "sets per-module ranks or alphas, which are not supported (use one r and alpha)");
  }
  // Variants and selections that change which modules are adapted or what they compute: refused when set.
  for (const char* field : {"layers_to_transform", "modules_to_save", "exclude_modules", "trainable_token_indices",
                            "layer_replication", "alora_invocation_tokens",
                            "megatron_config", "velora_config", "monteclora_config", "use_bdlora", "arrow_config",
                            "kasa_config"}) {
    const json* v = Get(j, field);
    if (v && !((v->is_array() || v->is_object() || v->is_string()) && v->empty()))
      return unsupported(field, "is set, which is not supported");
  }
  if (const json* base = Get(j, "base_model_name_or_path")) {
    if (!base->is_string())
      return error("base_model_name_or_path", absl::StrCat("must be a string, got ", JsonTypeName(*base)));
    c.base_model_name_or_path = base->get<std::string>();
  }
  if (const json* task = Get(j, "task_type")) {
    if (!task->is_string()) return error("task_type", absl::StrCat("must be a string, got ", JsonTypeName(*task)));
    c.task_type = task->get<std::string>();
  }
  return c;
}

absl::StatusOr<PeftLoraConfig> ReadPeftLoraConfig(const std::string& path) {
  absl::StatusOr<std::string> text = internal::ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParsePeftLoraConfig(*text, path);
}

std::string PeftLoraConfigToJson(const PeftLoraConfig& c) {
  nlohmann::ordered_json out;
  out["alpha_pattern"] = json::object();
  out["auto_mapping"] = nullptr;
  out["base_model_name_or_path"] = c.base_model_name_or_path;
  out["bias"] = "none";
  out["fan_in_fan_out"] = false;
  out["inference_mode"] = true;
  out["init_lora_weights"] = true;
  out["layers_pattern"] = nullptr;
  out["layers_to_transform"] = nullptr;
  out["lora_alpha"] = c.lora_alpha;
  out["lora_dropout"] = c.lora_dropout;
  out["modules_to_save"] = nullptr;
  out["peft_type"] = "LORA";
  out["r"] = c.r;
  out["rank_pattern"] = json::object();
  out["revision"] = nullptr;
  if (c.all_linear) out["target_modules"] = "all-linear";
  else out["target_modules"] = c.target_modules;
  if (!c.target_parameters.empty()) out["target_parameters"] = c.target_parameters;
  else out["target_parameters"] = nullptr;
  out["task_type"] = c.task_type;
  out["use_dora"] = false;
  out["use_rslora"] = false;
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace sg::io
