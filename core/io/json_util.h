// Helpers shared by the readers in core/io: strict JSON parsing with readable
// errors, and whole-file reads. Internal to core/io.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace sg::io::internal {

// Nesting beyond this is refused (configs and headers are a few levels deep).
constexpr size_t kMaxJsonDepth = 256;
// JSON files read whole (config.json, index, adapter_config.json) larger than this are refused unread.
constexpr int64_t kMaxJsonFileBytes = int64_t{256} << 20;

// Parses one JSON document in time linear in its size. Unlike plain
// nlohmann::json::parse this never throws, rejects duplicate object keys
// (nlohmann would silently keep the last one) and nesting deeper than
// kMaxJsonDepth, and reports where the text stops being JSON. The error
// message does not name the source; callers prefix it.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text);

// "object", "array", "string", "integer", "number", "boolean" or "null".
std::string JsonTypeName(const nlohmann::json& value);

// The value of a JSON integer that is >= 0, or nullopt for anything else
// (negative, fractional, too large to be stored as an integer, non-number).
std::optional<uint64_t> JsonNonNegativeInteger(const nlohmann::json& value);

// Whole contents of a regular file of at most kMaxJsonFileBytes; errors name the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

bool IsValidUtf8(std::string_view text);

// Abseil builds without ABSL_USES_STD_STRING_VIEW (Debian's among them) have
// their own string_view, which absl::StrCat needs to accept std::string_view.
inline absl::string_view AbslView(std::string_view text) { return {text.data(), text.size()}; }

}  // namespace sg::io::internal
