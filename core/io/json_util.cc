#include "core/io/json_util.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/io/file.h"

namespace sg::io::internal {
namespace {

using nlohmann::json;

// nlohmann messages quote the offending input, which may be binary; keep
// only printable ASCII so error messages stay readable and loggable.
std::string Printable(std::string_view text) {
  std::string out;
  for (char c : text) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

// Builds the DOM from SAX events, refusing duplicate keys and nesting deeper than kMaxJsonDepth. Linear in the
// input: a key is looked up once in its own object (nlohmann's callback parser instead rescans the parent object
// at every object end, quadratic for many small objects).
class DomBuilder : public nlohmann::json_sax<json> {
 public:
  bool null() override { return Put(nullptr) != nullptr; }
  bool boolean(bool v) override { return Put(v) != nullptr; }
  bool number_integer(number_integer_t v) override { return Put(v) != nullptr; }
  bool number_unsigned(number_unsigned_t v) override { return Put(v) != nullptr; }
  bool number_float(number_float_t v, const string_t&) override { return Put(v) != nullptr; }
  bool string(string_t& v) override { return Put(std::move(v)) != nullptr; }
  bool binary(binary_t& v) override { return Put(json::binary(std::move(v))) != nullptr; }
  bool start_object(std::size_t) override { return Open(json::object()); }
  bool key(string_t& k) override {
    json& object = *stack_.back();
    if (object.contains(k)) {
      error_ = absl::StrCat("duplicate JSON key '", Printable(k), "'");
      return false;
    }
    slot_ = &object[k];
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(json::array()); }
  bool end_array() override { return Close(); }
  // nlohmann's message already says where: line and column, or the number that overflowed.
  bool parse_error(std::size_t, const std::string&, const json::exception& e) override {
    std::string message = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag.
    if (size_t tag_end = message.find("] "); !message.empty() && message[0] == '[' && tag_end != std::string::npos)
      message.erase(0, tag_end + 2);
    error_ = absl::StrCat("not valid JSON (", Printable(message), ")");
    return false;
  }

  json& root() { return root_; }
  const std::string& error() const { return error_; }

 private:
  json* Put(json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& top = *stack_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return &top.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  bool Open(json container) {
    if (stack_.size() >= kMaxJsonDepth) {
      error_ = absl::StrCat("JSON nested deeper than ", kMaxJsonDepth, " levels");
      return false;
    }
    stack_.push_back(Put(std::move(container)));
    return true;
  }
  bool Close() {
    stack_.pop_back();
    return true;
  }

  json root_;
  std::vector<json*> stack_;  // the open objects and arrays, innermost last
  json* slot_ = nullptr;      // the value of the key just read
  std::string error_;
};

}  // namespace

absl::StatusOr<json> ParseJson(std::string_view text) {
  DomBuilder builder;
  if (!json::sax_parse(text.begin(), text.end(), &builder)) {
    return absl::InvalidArgumentError(builder.error().empty() ? "not valid JSON" : builder.error());
  }
  return std::move(builder.root());
}

std::string JsonTypeName(const json& value) {
  switch (value.type()) {
    case json::value_t::object: return "object";
    case json::value_t::array: return "array";
    case json::value_t::string: return "string";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    case json::value_t::boolean: return "boolean";
    case json::value_t::null: return "null";
    default: return "invalid value";
  }
}

std::optional<uint64_t> JsonNonNegativeInteger(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return std::nullopt;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  return ReadRegularFile(path, kMaxJsonFileBytes);
}

bool IsValidUtf8(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    unsigned char lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    uint32_t code_point;
    if ((lead & 0xe0) == 0xc0) {
      length = 2;
      code_point = lead & 0x1f;
    } else if ((lead & 0xf0) == 0xe0) {
      length = 3;
      code_point = lead & 0x0f;
    } else if ((lead & 0xf8) == 0xf0) {
      length = 4;
      code_point = lead & 0x07;
    } else {
      return false;
    }
    if (n - i < length) return false;
    for (size_t k = 1; k < length; ++k) {
      if ((bytes[i + k] & 0xc0) != 0x80) return false;
      code_point = (code_point << 6) | (bytes[i + k] & 0x3f);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (code_point < kMinForLength[length]) return false;          // overlong
    if (code_point > 0x10ffff) return false;                       // beyond Unicode
    if (code_point >= 0xd800 && code_point <= 0xdfff) return false;  // surrogate
    i += length;
  }
  return true;
}

}  // namespace sg::io::internal
