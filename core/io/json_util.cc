#include "core/io/json_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace sg::io::internal {
namespace {

using nlohmann::json;

// A SAX consumer that only records the first syntax error; used to explain
// why a document was rejected, since the non-throwing DOM parse does not say.
class SyntaxErrorRecorder : public nlohmann::json_sax<json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  // nlohmann's message already says where: line and column, or the number
  // that overflowed.
  bool parse_error(std::size_t, const std::string&, const json::exception& error) override {
    message_ = error.what();
    return false;
  }

  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// nlohmann messages quote the offending input, which may be binary; keep
// only printable ASCII so error messages stay readable and loggable.
std::string Printable(std::string_view text) {
  std::string out;
  for (char c : text) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

std::string DescribeSyntaxError(std::string_view text) {
  SyntaxErrorRecorder recorder;
  json::sax_parse(text.begin(), text.end(), &recorder);
  std::string message = recorder.message();
  // Drop nlohmann's "[json.exception.parse_error.101] " tag.
  if (size_t tag_end = message.find("] "); !message.empty() && message[0] == '[' &&
                                           tag_end != std::string::npos) {
    message.erase(0, tag_end + 2);
  }
  return Printable(message);
}

}  // namespace

absl::StatusOr<json> ParseJson(std::string_view text) {
  // One set of seen keys per currently open object.
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate_key;
  auto on_event = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string() && !duplicate_key &&
            !open_objects.back().insert(parsed.get_ref<const std::string&>()).second) {
          duplicate_key = parsed.get_ref<const std::string&>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json value = json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not valid JSON (", DescribeSyntaxError(text), ")"));
  }
  if (duplicate_key) {
    return absl::InvalidArgumentError(
        absl::StrCat("duplicate JSON key '", *duplicate_key, "'"));
  }
  return value;
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
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat info;
  if (fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int error = errno;
      close(fd);
      return absl::DataLossError(absl::StrCat(path, ": read failed: ", std::strerror(error)));
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return contents;
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
