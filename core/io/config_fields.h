// The plumbing every family's config.json parser shares: reading the file, typed field access whose errors name the
// file and the field, and what a config says its model is (for the registry, core/models/family.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/io/json_util.h"
#include "nlohmann/json.hpp"

namespace sg::io {

// Typed access to the fields of one JSON object, producing errors that name
// the source file and the field. A field set to null counts as absent, as in
// HF's own config classes.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& object, std::string source_name, std::string field_prefix = "")
      : object_(object), source_name_(std::move(source_name)), field_prefix_(std::move(field_prefix)) {}

  absl::Status Error(std::string_view field, std::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(source_name_, ": field '", field_prefix_, internal::AbslView(field),
                                                   "' ", internal::AbslView(problem)));
  }

  // Whether the field is there at all, null included.
  bool Has(std::string_view field) const { return object_.contains(std::string(field)); }

  const nlohmann::json* Get(std::string_view field) const {
    const auto it = object_.find(std::string(field));
    return (it == object_.end() || it->is_null()) ? nullptr : &*it;
  }

  absl::StatusOr<int64_t> PositiveInt(std::string_view field, std::optional<int64_t> fallback = std::nullopt) const {
    const nlohmann::json* value = Get(field);
    if (value == nullptr) {
      if (fallback) return *fallback;
      return Error(field, "is missing");
    }
    if (!value->is_number_integer()) {
      return Error(field, absl::StrCat("must be an integer, got ", internal::JsonTypeName(*value)));
    }
    // Values above INT64_MAX are stored unsigned; they are absurd sizes anyway.
    if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Error(field, absl::StrCat("is too large: ", value->dump()));
    }
    const int64_t number = value->get<int64_t>();
    if (number <= 0) return Error(field, absl::StrCat("must be positive, got ", number));
    return number;
  }

  absl::StatusOr<double> PositiveNumber(std::string_view field, std::optional<double> fallback = std::nullopt) const {
    const nlohmann::json* value = Get(field);
    if (value == nullptr) {
      if (fallback) return *fallback;
      return Error(field, "is missing");
    }
    if (!value->is_number()) {
      return Error(field, absl::StrCat("must be a number, got ", internal::JsonTypeName(*value)));
    }
    const double number = value->get<double>();
    if (!(number > 0) || !std::isfinite(number)) {
      return Error(field, absl::StrCat("must be a positive finite number, got ", value->dump()));
    }
    return number;
  }

  absl::StatusOr<bool> Bool(std::string_view field, bool fallback) const {
    const nlohmann::json* value = Get(field);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) {
      return Error(field, absl::StrCat("must be a boolean, got ", internal::JsonTypeName(*value)));
    }
    return value->get<bool>();
  }

  // nullopt when absent.
  absl::StatusOr<std::optional<std::string>> String(std::string_view field) const {
    const nlohmann::json* value = Get(field);
    if (value == nullptr) return std::optional<std::string>();
    if (!value->is_string()) {
      return Error(field, absl::StrCat("must be a string, got ", internal::JsonTypeName(*value)));
    }
    return std::optional<std::string>(value->get_ref<const std::string&>());
  }

 private:
  const nlohmann::json& object_;
  std::string source_name_;
  std::string field_prefix_;
};

// Assigns the value of a StatusOr expression to `lhs`, or returns its error.
#define SG_IO_ASSIGN_OR_RETURN(lhs, expression)                   \
  do {                                                            \
    auto sg_assign_result = (expression);                         \
    if (!sg_assign_result.ok()) return sg_assign_result.status(); \
    lhs = *std::move(sg_assign_result);                           \
  } while (false)

// config.json text as a JSON object; errors name source_name.
absl::StatusOr<nlohmann::json> ParseConfigObject(const std::string& json_text, const std::string& source_name);

// The text of `path`, or of `path`/config.json when `path` is a directory, and the file it came from.
absl::StatusOr<std::pair<std::string, std::string>> ReadConfigJson(const std::string& path);

// What a config.json says its model is: model_type (absent in some exports) and the architectures' names, from which
// the registry picks the family that reads it (core/models/family.h). Errors name the field.
struct ConfigModelType {
  std::optional<std::string> model_type;
  std::vector<std::string> architectures;
};
absl::StatusOr<ConfigModelType> ReadConfigModelType(const std::string& json_text, const std::string& source_name);

}  // namespace sg::io
