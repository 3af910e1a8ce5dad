#include "core/io/config_fields.h"

#include <sys/stat.h>

namespace sg::io {

using nlohmann::json;

absl::StatusOr<json> ParseConfigObject(const std::string& json_text, const std::string& source_name) {
  absl::StatusOr<json> parsed = internal::ParseJson(json_text);
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", parsed.status().message()));
  if (!parsed->is_object())
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": must be a JSON object, got ", internal::JsonTypeName(*parsed)));
  return parsed;
}

absl::StatusOr<std::pair<std::string, std::string>> ReadConfigJson(const std::string& path) {
  struct stat info;
  std::string file = path;
  if (stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    file = (!path.empty() && path.back() == '/') ? path + "config.json" : path + "/config.json";
  }
  absl::StatusOr<std::string> text = internal::ReadFileToString(file);
  if (!text.ok()) return text.status();
  return std::make_pair(*std::move(text), file);
}

absl::StatusOr<ConfigModelType> ReadConfigModelType(const std::string& json_text, const std::string& source_name) {
  absl::StatusOr<json> parsed = ParseConfigObject(json_text, source_name);
  if (!parsed.ok()) return parsed.status();
  const FieldReader fields(*parsed, source_name);
  ConfigModelType type;
  SG_IO_ASSIGN_OR_RETURN(type.model_type, fields.String("model_type"));
  const json* architectures = fields.Get("architectures");
  if (architectures && architectures->is_array())
    for (const json& name : *architectures)
      if (name.is_string()) type.architectures.push_back(name.get<std::string>());
  return type;
}

}  // namespace sg::io
