#include "core/models/family.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/io/config_fields.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"

namespace sg {

void ModelSpec::InitRandom(Model& model, uint64_t seed) const {
  InitOptions init;
  init.seed = seed;
  sg::InitRandom(model, init);
}

// A new family is one line here.
const std::vector<const ModelFamily*>& ModelFamilies() {
  static const std::vector<const ModelFamily*> families = {&TransformerModelFamily(), &MambaModelFamily()};
  return families;
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const ModelFamily* family : ModelFamilies())
    for (std::string& name : family->PresetNames()) names.push_back(std::move(name));
  return names;
}

absl::StatusOr<std::unique_ptr<ModelSpec>> PresetSpec(const std::string& name) {
  for (const ModelFamily* family : ModelFamilies())
    if (std::unique_ptr<ModelSpec> spec = family->Preset(name)) return spec;
  return absl::NotFoundError(absl::StrCat("--model: '", name, "' is neither a preset (",
                                          absl::StrJoin(PresetNames(), ", "), ") nor a directory with config.json"));
}

absl::StatusOr<std::unique_ptr<ModelSpec>> ParseConfigSpec(const std::string& json_text,
                                                           const std::string& source_name) {
  absl::StatusOr<io::ConfigModelType> type = io::ReadConfigModelType(json_text, source_name);
  if (!type.ok()) return type.status();
  for (const ModelFamily* family : ModelFamilies())
    if (family->Reads(type->model_type, type->architectures)) return family->ParseConfig(json_text, source_name);
  // A config no family reads goes to the first, whose parser names the model types it supports.
  return ModelFamilies().front()->ParseConfig(json_text, source_name);
}

absl::StatusOr<std::unique_ptr<ModelSpec>> LoadConfigSpec(const std::string& path) {
  absl::StatusOr<std::pair<std::string, std::string>> text = io::ReadConfigJson(path);
  if (!text.ok()) return text.status();
  return ParseConfigSpec(text->first, text->second);
}

}  // namespace sg
