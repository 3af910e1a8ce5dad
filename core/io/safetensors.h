// Reading and writing the safetensors checkpoint format used by Hugging Face:
//   [u64 little-endian header length N][N bytes of JSON header][data section]
// The header maps each tensor name to {"dtype", "shape", "data_offsets"}
// (offsets relative to the data section) plus an optional "__metadata__"
// string map. Readers validate the whole header up front, so every accessor
// afterwards works on checked offsets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace sg::io {

// Element types that may appear in a safetensors header.
enum class StDType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

std::string_view StDTypeName(StDType dtype);  // "F64", "BF16", ...
size_t StDTypeSize(StDType dtype);
std::optional<StDType> StDTypeFromName(std::string_view name);

struct TensorInfo {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  // [data_begin, data_end) within the data section, as written in the header.
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
  // The tensor's bytes; valid while any copy of the owning file object lives.
  absl::Span<const uint8_t> bytes;
};

namespace internal {
class ByteSource;
}

class SafetensorsFile {
 public:
  // Maps the file and validates its header; errors name `path`.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  // Same validation on bytes already in memory; errors name `source_name`.
  static absl::StatusOr<SafetensorsFile> FromBytes(std::string bytes,
                                                   const std::string& source_name);

  const std::string& path() const { return path_; }
  // Tensors in data-section order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when there is no such tensor.
  const TensorInfo* Find(std::string_view name) const;

  // Converts tensor `name` into `dst`, which holds `dst_count` elements of
  // `target`. Floating-point tensors (F64/F32/F16/BF16) convert to any of
  // f64/f32/bf16/f16; I32/I64 tensors copy only into the same type.
  absl::Status ReadAs(std::string_view name, DType target, void* dst,
                      size_t dst_count) const;
  // ReadAs after checking that the tensor's shape equals `expected_shape`;
  // `dst` must hold the product of `expected_shape` elements.
  absl::Status ReadInto(std::string_view name, absl::Span<const int64_t> expected_shape,
                        DType target, void* dst) const;

 private:
  static absl::StatusOr<SafetensorsFile> Parse(
      std::shared_ptr<const internal::ByteSource> source, const std::string& source_name);

  std::string path_;
  std::shared_ptr<const internal::ByteSource> source_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_by_name_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: either a single model.safetensors or shards listed
// by model.safetensors.index.json ({"weight_map": {tensor name: shard file}}).
class ShardedSafetensors {
 public:
  static absl::StatusOr<ShardedSafetensors> OpenDir(const std::string& dir);

  // model.safetensors or the index file; errors about lookups name it.
  const std::string& source() const { return source_; }
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  // Every tensor name in the checkpoint, sorted.
  std::vector<std::string> TensorNames() const;
  const TensorInfo* Find(std::string_view name) const;
  absl::Status ReadAs(std::string_view name, DType target, void* dst,
                      size_t dst_count) const;
  absl::Status ReadInto(std::string_view name, absl::Span<const int64_t> expected_shape,
                        DType target, void* dst) const;

 private:
  // The shard holding `name`, or a NotFound error naming source().
  absl::StatusOr<const SafetensorsFile*> ShardFor(std::string_view name) const;

  std::string source_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, size_t, std::less<>> shard_by_name_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;                 // any sg::DType; stored as F32/F64/BF16/F16/I32/I64
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel * DTypeSize(dtype) bytes, host memory
};

// The complete file contents: header padded with spaces to a multiple of 8
// bytes, then tensor data ordered by element size, largest first (otherwise
// in the given order), so that every tensor is aligned to its element size as
// in files HF writes. "format": "pt" is added to the metadata unless it
// already has a "format" key, as HF loaders expect it.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Writes the same bytes to `path` atomically: a temporary file in the same
// directory is flushed to disk and renamed over `path`, so readers see either
// the old file or the complete new one.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace sg::io
