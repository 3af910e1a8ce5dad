#include "core/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "core/io/file.h"
#include "core/io/json_util.h"
#include "nlohmann/json.hpp"

// Tensor bytes are copied to and from memory as-is, and safetensors is
// little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace sg::io {

namespace internal {

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual absl::Span<const uint8_t> bytes() const = 0;
};

}  // namespace internal

namespace {

using internal::AbslView;
using internal::ByteSource;
using internal::JsonNonNegativeInteger;
using internal::JsonTypeName;
using nlohmann::json;

// Same cap as the reference implementation: a larger header is corrupt or
// hostile, and parsing it would take unbounded memory.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

class MappedFile : public ByteSource {
 public:
  MappedFile(const void* data, size_t size) : data_(data), size_(size) {}
  ~MappedFile() override { munmap(const_cast<void*>(data_), size_); }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  absl::Span<const uint8_t> bytes() const override {
    return {static_cast<const uint8_t*>(data_), size_};
  }

 private:
  const void* data_;
  size_t size_;
};

class InMemoryBytes : public ByteSource {
 public:
  explicit InMemoryBytes(std::string bytes) : bytes_(std::move(bytes)) {}
  absl::Span<const uint8_t> bytes() const override {
    return {reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size()};
  }

 private:
  std::string bytes_;
};

absl::StatusOr<std::shared_ptr<const ByteSource>> MapFile(const std::string& path) {
  struct stat info;
  absl::StatusOr<ReadFd> file = OpenRegularFile(path, &info);
  if (!file.ok()) return file.status();
  const int fd = file->get();
  const size_t size = static_cast<size_t>(info.st_size);
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file is ", size, " bytes, too short for the 8-byte header length"));
  }
  void* data = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_error = errno;
  if (data == MAP_FAILED) {
    return ErrnoStatus(mmap_error, absl::StrCat(path, ": mmap failed"));
  }
  return std::make_shared<const MappedFile>(data, size);
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string OffsetsString(uint64_t begin, uint64_t end) {
  return absl::StrCat("[", begin, ", ", end, ")");
}

// Numbers are shown by value (so "-3" or "1e+300" is visible), anything else
// by its type.
std::string DescribeJsonValue(const json& value) {
  if (value.is_number()) return value.dump();
  return JsonTypeName(value);
}

std::optional<DType> EngineDType(StDType dtype) {
  switch (dtype) {
    case StDType::kF64: return DType::kF64;
    case StDType::kF32: return DType::kF32;
    case StDType::kF16: return DType::kF16;
    case StDType::kBF16: return DType::kBF16;
    case StDType::kI64: return DType::kI64;
    case StDType::kI32: return DType::kI32;
    default: return std::nullopt;
  }
}

std::optional<StDType> FileDType(DType dtype) {
  switch (dtype) {
    case DType::kF64: return StDType::kF64;
    case DType::kF32: return StDType::kF32;
    case DType::kF16: return StDType::kF16;
    case DType::kBF16: return StDType::kBF16;
    case DType::kI64: return StDType::kI64;
    case DType::kI32: return StDType::kI32;
  }
  return std::nullopt;
}

bool IsFloat(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kBF16 ||
         dtype == DType::kF16;
}

// Element count of `shape`, or nullopt when it (or its size in bytes with
// `element_size`-byte elements) does not fit in int64.
std::optional<int64_t> CheckedNumel(absl::Span<const int64_t> shape, size_t element_size) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(numel, dim, &numel)) return std::nullopt;
  }
  int64_t bytes;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(element_size), &bytes)) {
    return std::nullopt;
  }
  return numel;
}

// Element-by-element conversion through memcpy: neither the mapped file nor
// the caller's buffer is guaranteed to be aligned for the element type.
template <typename Stored, typename Out, typename Convert>
void ConvertElements(const uint8_t* src, size_t count, void* dst, Convert convert) {
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < count; ++i) {
    Stored stored;
    std::memcpy(&stored, src + i * sizeof(Stored), sizeof(Stored));
    const Out value = convert(stored);
    std::memcpy(out + i * sizeof(Out), &value, sizeof(Out));
  }
}

// `decode` turns a `Stored` element into float or double.
template <typename Stored, typename Decode>
void ConvertFloats(const uint8_t* src, size_t count, Decode decode, DType target, void* dst) {
  switch (target) {
    case DType::kF64:
      ConvertElements<Stored, double>(src, count, dst, [&](Stored s) {
        return static_cast<double>(decode(s));
      });
      break;
    case DType::kF32:
      ConvertElements<Stored, float>(src, count, dst, [&](Stored s) {
        return static_cast<float>(decode(s));
      });
      break;
    case DType::kBF16:
      ConvertElements<Stored, uint16_t>(src, count, dst, [&](Stored s) {
        return F32ToBF16(static_cast<float>(decode(s)));
      });
      break;
    case DType::kF16:
      ConvertElements<Stored, uint16_t>(src, count, dst, [&](Stored s) {
        return F32ToF16(static_cast<float>(decode(s)));
      });
      break;
    default:
      break;  // callers only pass floating-point targets
  }
}

absl::Status ConvertTensor(const TensorInfo& info, DType target, void* dst,
                           const std::string& path) {
  const std::optional<DType> source = EngineDType(info.dtype);
  const bool same_type = source == target;
  if (!same_type && !(source && IsFloat(*source) && IsFloat(target))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor '", info.name, "': dtype ", AbslView(StDTypeName(info.dtype)),
                     " cannot be read as ", AbslView(DTypeName(target))));
  }
  if (info.numel == 0) return absl::OkStatus();
  if (dst == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor '", info.name, "': destination is null"));
  }
  const uint8_t* src = info.bytes.data();
  const size_t count = static_cast<size_t>(info.numel);
  if (same_type) {
    std::memcpy(dst, src, info.bytes.size());
    return absl::OkStatus();
  }
  switch (info.dtype) {
    case StDType::kF64:
      ConvertFloats<double>(src, count, [](double v) { return v; }, target, dst);
      break;
    case StDType::kF32:
      ConvertFloats<float>(src, count, [](float v) { return v; }, target, dst);
      break;
    case StDType::kBF16:
      ConvertFloats<uint16_t>(src, count, BF16ToF32, target, dst);
      break;
    case StDType::kF16:
      ConvertFloats<uint16_t>(src, count, F16ToF32, target, dst);
      break;
    default:
      break;  // rejected above
  }
  return absl::OkStatus();
}

absl::Status ReadIntoChecked(const TensorInfo& info, absl::Span<const int64_t> expected_shape,
                             DType target, void* dst, const std::string& path) {
  if (!std::equal(info.shape.begin(), info.shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", info.name, "': shape ", ShapeString(info.shape),
        " does not match expected ", ShapeString(expected_shape)));
  }
  return ConvertTensor(info, target, dst, path);
}

absl::Status CheckDestinationCount(const TensorInfo& info, DType target, size_t dst_count,
                                   const std::string& path) {
  if (dst_count == static_cast<uint64_t>(info.numel)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor '", info.name, "': destination holds ", dst_count, " ",
                   AbslView(DTypeName(target)), " elements but the tensor has ", info.numel));
}

// Validates one header entry `name: {"dtype", "shape", "data_offsets"}`
// against a data section of `data` bytes.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& path, const std::string& name,
                                            const json& entry,
                                            absl::Span<const uint8_t> data) {
  const std::string context = absl::StrCat(path, ": tensor '", name, "': ");
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, parts...));
  };
  if (!entry.is_object()) {
    return error("entry must be a JSON object, got ", JsonTypeName(entry));
  }
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return error("unexpected field '", it.key(), "'");
    }
  }
  TensorInfo info;
  info.name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return error("missing field 'dtype'");
  if (!dtype_it->is_string()) {
    return error("field 'dtype' must be a string, got ", JsonTypeName(*dtype_it));
  }
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const std::optional<StDType> dtype = StDTypeFromName(dtype_name);
  if (!dtype) {
    return error("field 'dtype': unknown dtype '", dtype_name,
                 "' (expected F64, F32, F16, BF16, I64, I32, I16, I8, U8 or BOOL)");
  }
  info.dtype = *dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return error("missing field 'shape'");
  if (!shape_it->is_array()) {
    return error("field 'shape' must be an array, got ", JsonTypeName(*shape_it));
  }
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& dim = (*shape_it)[i];
    const std::optional<uint64_t> value = JsonNonNegativeInteger(dim);
    if (!value || *value > static_cast<uint64_t>(INT64_MAX)) {
      return error("field 'shape': dimension ", i, " must be a non-negative integer, got ",
                   DescribeJsonValue(dim));
    }
    info.shape.push_back(static_cast<int64_t>(*value));
  }
  const size_t element_size = StDTypeSize(info.dtype);
  const std::optional<int64_t> numel = CheckedNumel(info.shape, element_size);
  if (!numel) {
    return error("field 'shape': ", ShapeString(info.shape), " of ", dtype_name,
                 " is too large (byte size overflows int64)");
  }
  info.numel = *numel;

  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end()) return error("missing field 'data_offsets'");
  if (!offsets_it->is_array() || offsets_it->size() != 2) {
    return error("field 'data_offsets' must be an array of 2 integers, got ",
                 offsets_it->is_array() ? absl::StrCat("an array of ", offsets_it->size())
                                        : JsonTypeName(*offsets_it));
  }
  const std::optional<uint64_t> begin = JsonNonNegativeInteger((*offsets_it)[0]);
  const std::optional<uint64_t> end = JsonNonNegativeInteger((*offsets_it)[1]);
  if (!begin || !end) {
    return error("field 'data_offsets' must hold non-negative integers, got [",
                 DescribeJsonValue((*offsets_it)[0]), ", ",
                 DescribeJsonValue((*offsets_it)[1]), "]");
  }
  if (*begin > *end) {
    return error("data_offsets ", OffsetsString(*begin, *end), ": begin is after end");
  }
  if (*end > data.size()) {
    return error("data_offsets ", OffsetsString(*begin, *end), " exceed data section of ",
                 data.size(), " bytes");
  }
  const uint64_t needed_bytes = static_cast<uint64_t>(info.numel) * element_size;
  if (*end - *begin != needed_bytes) {
    return error("data_offsets ", OffsetsString(*begin, *end), " span ", *end - *begin,
                 " bytes but shape ", ShapeString(info.shape), " of ", dtype_name, " needs ",
                 needed_bytes);
  }
  info.data_begin = *begin;
  info.data_end = *end;
  info.bytes = data.subspan(*begin, *end - *begin);
  return info;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const std::string& path,
                                                                 const json& value) {
  if (!value.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": field '__metadata__' must be an object of strings, got ", JsonTypeName(value)));
  }
  std::map<std::string, std::string> metadata;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field '__metadata__': key '", it.key(),
                       "' must have a string value, got ", JsonTypeName(*it)));
    }
    metadata[it.key()] = it->get_ref<const std::string&>();
  }
  return metadata;
}

std::string JoinPath(const std::string& dir, const std::string& file) {
  if (dir.empty()) return file;
  if (dir.back() == '/') return dir + file;
  return absl::StrCat(dir, "/", file);
}

bool PathExists(const std::string& path) {
  struct stat info;
  return stat(path.c_str(), &info) == 0;
}

// Only for tensors BuildHeader accepted, whose sizes are known to fit.
size_t TensorByteSize(const TensorToWrite& tensor) {
  size_t numel = 1;
  for (int64_t dim : tensor.shape) numel *= static_cast<size_t>(dim);
  return numel * DTypeSize(tensor.dtype);
}

// Data-section order: larger elements first (stable), as HF's writer does.
// The data section starts 8-byte aligned, so every tensor then starts at a
// multiple of its element size, which loaders that view mapped bytes as the
// element type (torch among them) require.
std::vector<size_t> DataOrder(const std::vector<TensorToWrite>& tensors) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].dtype) > DTypeSize(tensors[b].dtype);
  });
  return order;
}

// Builds the header (length prefix, JSON, space padding) for `tensors` laid
// out in DataOrder, and checks everything the reader would check. Errors
// name `target`.
absl::StatusOr<std::string> BuildHeader(const std::string& target,
                                        const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(target, ": ", parts...));
  };
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json metadata_json = nlohmann::ordered_json::object();
  if (metadata.find("format") == metadata.end()) metadata_json["format"] = "pt";
  for (const auto& [key, value] : metadata) {
    if (!internal::IsValidUtf8(key) || !internal::IsValidUtf8(value)) {
      return error("metadata entry is not valid UTF-8");
    }
    metadata_json[key] = value;
  }
  header[std::string(kMetadataKey)] = std::move(metadata_json);

  std::set<std::string_view> seen_names;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& tensor = tensors[i];
    if (tensor.name.empty()) return error("tensor #", i, " has an empty name");
    if (tensor.name == kMetadataKey || !internal::IsValidUtf8(tensor.name)) {
      return error("tensor #", i, ": name is reserved or not valid UTF-8");
    }
    if (!seen_names.insert(tensor.name).second) {
      return error("tensor '", tensor.name, "' appears twice");
    }
    if (!FileDType(tensor.dtype)) {
      return error("tensor '", tensor.name, "': unsupported dtype ",
                   static_cast<int>(tensor.dtype));
    }
    const std::optional<int64_t> numel = CheckedNumel(tensor.shape, DTypeSize(tensor.dtype));
    if (!numel) {
      return error("tensor '", tensor.name, "': shape ", ShapeString(tensor.shape),
                   " has a negative dimension or is too large");
    }
    const uint64_t bytes = static_cast<uint64_t>(*numel) * DTypeSize(tensor.dtype);
    if (bytes > 0 && tensor.data == nullptr) {
      return error("tensor '", tensor.name, "': data is null");
    }
    if (__builtin_add_overflow(total_bytes, bytes, &total_bytes)) {
      return error("tensor '", tensor.name, "': total data size overflows");
    }
  }

  uint64_t offset = 0;
  for (size_t i : DataOrder(tensors)) {
    const TensorToWrite& tensor = tensors[i];
    const uint64_t end = offset + TensorByteSize(tensor);
    header[tensor.name] = {{"dtype", std::string(StDTypeName(*FileDType(tensor.dtype)))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, end}}};
    offset = end;
  }

  std::string text = header.dump();
  // HF pads with spaces so that the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string prefixed(8, '\0');
  for (int i = 0; i < 8; ++i) {
    prefixed[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  return prefixed + text;
}

absl::Status WriteFully(std::FILE* file, const void* data, size_t size, const std::string& path) {
  if (size > 0 && std::fwrite(data, 1, size, file) != size) {
    return ErrnoStatus(errno, absl::StrCat(path, ": write failed"));
  }
  return absl::OkStatus();
}

absl::Status SyncDirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoStatus(errno, absl::StrCat(path, ": cannot open directory to sync"));
  }
  const int result = fsync(fd);
  const int sync_error = errno;
  close(fd);
  if (result != 0) {
    return ErrnoStatus(sync_error, absl::StrCat(path, ": directory fsync failed"));
  }
  return absl::OkStatus();
}

// Writes header and tensor data into `temp_path`, flushed to disk.
absl::Status WriteTemporary(const std::string& temp_path, const std::string& header,
                            const std::vector<TensorToWrite>& tensors) {
  std::FILE* file = std::fopen(temp_path.c_str(), "wb");
  if (file == nullptr) {
    return ErrnoStatus(errno, absl::StrCat(temp_path, ": cannot create"));
  }
  absl::Status status = WriteFully(file, header.data(), header.size(), temp_path);
  for (size_t i : DataOrder(tensors)) {
    if (!status.ok()) break;
    status = WriteFully(file, tensors[i].data, TensorByteSize(tensors[i]), temp_path);
  }
  if (status.ok() && (std::fflush(file) != 0 || fsync(fileno(file)) != 0)) {
    status = ErrnoStatus(errno, absl::StrCat(temp_path, ": flush to disk failed"));
  }
  if (std::fclose(file) != 0 && status.ok()) {
    status = ErrnoStatus(errno, absl::StrCat(temp_path, ": close failed"));
  }
  return status;
}

}  // namespace

std::string_view StDTypeName(StDType dtype) {
  switch (dtype) {
    case StDType::kF64: return "F64";
    case StDType::kF32: return "F32";
    case StDType::kF16: return "F16";
    case StDType::kBF16: return "BF16";
    case StDType::kI64: return "I64";
    case StDType::kI32: return "I32";
    case StDType::kI16: return "I16";
    case StDType::kI8: return "I8";
    case StDType::kU8: return "U8";
    case StDType::kBool: return "BOOL";
  }
  return "?";
}

size_t StDTypeSize(StDType dtype) {
  switch (dtype) {
    case StDType::kF64: case StDType::kI64: return 8;
    case StDType::kF32: case StDType::kI32: return 4;
    case StDType::kF16: case StDType::kBF16: case StDType::kI16: return 2;
    case StDType::kI8: case StDType::kU8: case StDType::kBool: return 1;
  }
  return 0;
}

std::optional<StDType> StDTypeFromName(std::string_view name) {
  for (StDType dtype : {StDType::kF64, StDType::kF32, StDType::kF16, StDType::kBF16,
                        StDType::kI64, StDType::kI32, StDType::kI16, StDType::kI8,
                        StDType::kU8, StDType::kBool}) {
    if (StDTypeName(dtype) == name) return dtype;
  }
  return std::nullopt;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  absl::StatusOr<std::shared_ptr<const ByteSource>> source = MapFile(path);
  if (!source.ok()) return source.status();
  return Parse(*std::move(source), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::string bytes,
                                                           const std::string& source_name) {
  return Parse(std::make_shared<const InMemoryBytes>(std::move(bytes)), source_name);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::shared_ptr<const ByteSource> source,
                                                       const std::string& source_name) {
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", parts...));
  };
  const absl::Span<const uint8_t> file = source->bytes();
  if (file.size() < 8) {
    return error("file is ", file.size(), " bytes, too short for the 8-byte header length");
  }
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | file[i];
  const uint64_t after_prefix = file.size() - 8;
  if (header_length > kMaxHeaderBytes) {
    return error("header length ", header_length, " exceeds the limit of ", kMaxHeaderBytes,
                 " bytes");
  }
  if (header_length > after_prefix) {
    return error("header length ", header_length, " exceeds the ", after_prefix,
                 " bytes after the length prefix");
  }
  const std::string_view header_text(reinterpret_cast<const char*>(file.data() + 8),
                                     header_length);
  absl::StatusOr<json> header = internal::ParseJson(header_text);
  if (!header.ok()) return error("header: ", header.status().message());
  if (!header->is_object()) {
    return error("header must be a JSON object, got ", JsonTypeName(*header));
  }

  SafetensorsFile result;
  result.path_ = source_name;
  const absl::Span<const uint8_t> data = file.subspan(8 + header_length);
  for (auto it = header->begin(); it != header->end(); ++it) {
    if (it.key() == kMetadataKey) {
      absl::StatusOr<std::map<std::string, std::string>> metadata =
          ParseMetadata(source_name, it.value());
      if (!metadata.ok()) return metadata.status();
      result.metadata_ = *std::move(metadata);
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(source_name, it.key(), it.value(), data);
    if (!info.ok()) return info.status();
    result.tensors_.push_back(*std::move(info));
  }

  std::sort(result.tensors_.begin(), result.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return std::tie(a.data_begin, a.data_end) < std::tie(b.data_begin, b.data_end);
            });
  // Empty tensors occupy no bytes, so they cannot overlap anything.
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo& info : result.tensors_) {
    if (info.data_begin == info.data_end) continue;
    if (furthest != nullptr && info.data_begin < furthest->data_end) {
      return error("tensors '", furthest->name, "' data_offsets ",
                   OffsetsString(furthest->data_begin, furthest->data_end), " and '", info.name,
                   "' data_offsets ", OffsetsString(info.data_begin, info.data_end), " overlap");
    }
    if (furthest == nullptr || info.data_end > furthest->data_end) furthest = &info;
  }
  for (size_t i = 0; i < result.tensors_.size(); ++i) {
    result.index_by_name_.emplace(result.tensors_[i].name, i);
  }
  result.source_ = std::move(source);
  return result;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_by_name_.find(name);
  return it == index_by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::ReadAs(std::string_view name, DType target, void* dst,
                                     size_t dst_count) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named '", AbslView(name), "'"));
  }
  if (absl::Status status = CheckDestinationCount(*info, target, dst_count, path_); !status.ok()) {
    return status;
  }
  return ConvertTensor(*info, target, dst, path_);
}

absl::Status SafetensorsFile::ReadInto(std::string_view name,
                                       absl::Span<const int64_t> expected_shape, DType target,
                                       void* dst) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named '", AbslView(name), "'"));
  }
  return ReadIntoChecked(*info, expected_shape, target, dst, path_);
}

absl::StatusOr<ShardedSafetensors> ShardedSafetensors::OpenDir(const std::string& dir) {
  ShardedSafetensors result;
  const std::string single_path = JoinPath(dir, "model.safetensors");
  if (PathExists(single_path)) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(single_path);
    if (!file.ok()) return file.status();
    result.source_ = single_path;
    for (const TensorInfo& info : file->tensors()) result.shard_by_name_.emplace(info.name, 0);
    result.shards_.push_back(*std::move(file));
    return result;
  }

  const std::string index_path = JoinPath(dir, "model.safetensors.index.json");
  if (!PathExists(index_path)) {
    return absl::NotFoundError(absl::StrCat(
        dir, ": neither model.safetensors nor model.safetensors.index.json exists"));
  }
  result.source_ = index_path;
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", parts...));
  };
  absl::StatusOr<std::string> text = internal::ReadFileToString(index_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<json> index = internal::ParseJson(*text);
  if (!index.ok()) return error(index.status().message());
  if (!index->is_object()) return error("must be a JSON object, got ", JsonTypeName(*index));
  const auto weight_map = index->find("weight_map");
  if (weight_map == index->end()) return error("missing field 'weight_map'");
  if (!weight_map->is_object()) {
    return error("field 'weight_map' must be an object, got ", JsonTypeName(*weight_map));
  }
  if (weight_map->empty()) return error("field 'weight_map' is empty");

  std::map<std::string, size_t> shard_index_by_file;
  for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
    const std::string& tensor_name = it.key();
    if (!it->is_string()) {
      return error("weight_map: tensor '", tensor_name, "' must map to a shard file name, got ",
                   JsonTypeName(*it));
    }
    const std::string& shard_file = it->get_ref<const std::string&>();
    // Shards live beside the index; anything else could escape the directory.
    if (shard_file.empty() || shard_file == "." || shard_file == ".." ||
        shard_file.find('/') != std::string::npos) {
      return error("weight_map: tensor '", tensor_name, "' maps to '", shard_file,
                   "', which is not a plain file name");
    }
    auto [shard_it, inserted] = shard_index_by_file.emplace(shard_file, result.shards_.size());
    if (inserted) {
      const std::string shard_path = JoinPath(dir, shard_file);
      if (!PathExists(shard_path)) {
        return error("weight_map: shard '", shard_file, "' (for tensor '", tensor_name,
                     "') does not exist");
      }
      absl::StatusOr<SafetensorsFile> shard = SafetensorsFile::Open(shard_path);
      if (!shard.ok()) {
        return absl::Status(shard.status().code(),
                            absl::StrCat(index_path, ": ", shard.status().message()));
      }
      result.shards_.push_back(*std::move(shard));
    }
    if (result.shards_[shard_it->second].Find(tensor_name) == nullptr) {
      return error("weight_map: tensor '", tensor_name, "' maps to shard '", shard_file,
                   "', which has no such tensor");
    }
    result.shard_by_name_.emplace(tensor_name, shard_it->second);
  }
  // A tensor the index does not list (or lists under another shard) means
  // the index and the shards disagree about the checkpoint's contents.
  for (size_t shard = 0; shard < result.shards_.size(); ++shard) {
    for (const TensorInfo& info : result.shards_[shard].tensors()) {
      const auto assigned = result.shard_by_name_.find(info.name);
      if (assigned == result.shard_by_name_.end() || assigned->second != shard) {
        return error("shard '", result.shards_[shard].path(), "' holds tensor '", info.name,
                     "', which weight_map does not assign to it");
      }
    }
  }
  return result;
}

std::vector<std::string> ShardedSafetensors::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(shard_by_name_.size());
  for (const auto& [name, shard] : shard_by_name_) names.push_back(name);
  return names;
}

absl::StatusOr<const SafetensorsFile*> ShardedSafetensors::ShardFor(std::string_view name) const {
  const auto it = shard_by_name_.find(name);
  if (it == shard_by_name_.end()) {
    return absl::NotFoundError(absl::StrCat(source_, ": no tensor named '", AbslView(name), "'"));
  }
  return &shards_[it->second];
}

const TensorInfo* ShardedSafetensors::Find(std::string_view name) const {
  absl::StatusOr<const SafetensorsFile*> shard = ShardFor(name);
  return shard.ok() ? (*shard)->Find(name) : nullptr;
}

absl::Status ShardedSafetensors::ReadAs(std::string_view name, DType target, void* dst,
                                        size_t dst_count) const {
  absl::StatusOr<const SafetensorsFile*> shard = ShardFor(name);
  if (!shard.ok()) return shard.status();
  return (*shard)->ReadAs(name, target, dst, dst_count);
}

absl::Status ShardedSafetensors::ReadInto(std::string_view name,
                                          absl::Span<const int64_t> expected_shape, DType target,
                                          void* dst) const {
  absl::StatusOr<const SafetensorsFile*> shard = ShardFor(name);
  if (!shard.ok()) return shard.status();
  return (*shard)->ReadInto(name, expected_shape, target, dst);
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = BuildHeader("SerializeSafetensors", tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  for (size_t i : DataOrder(tensors)) {
    const size_t size = TensorByteSize(tensors[i]);
    if (size > 0) bytes->append(static_cast<const char*>(tensors[i].data), size);
  }
  return bytes;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> header = BuildHeader(path, tensors, metadata);
  if (!header.ok()) return header.status();
  absl::StatusOr<LockedTemporary> temp = LockedTemporary::Create(path);
  if (!temp.ok()) return temp.status();
  const std::string& temp_path = temp->path();
  if (absl::Status status = WriteTemporary(temp_path, *header, tensors); !status.ok()) {
    std::remove(temp_path.c_str());
    return status;
  }
  if (std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int rename_error = errno;
    std::remove(temp_path.c_str());
    return ErrnoStatus(rename_error, absl::StrCat(path, ": cannot rename ", temp_path, " into place"));
  }
  return SyncDirectoryOf(path);
}

}  // namespace sg::io
