#include "tests/fuzz/targets.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/data.h"
#include "core/io/config_fields.h"
#include "core/io/safetensors.h"
#include "core/models/mamba/config.h"
#include "core/models/transformer/config.h"

namespace sg::fuzz {
namespace {

std::string Text(const uint8_t* data, size_t size) { return std::string(reinterpret_cast<const char*>(data), size); }

// A per-process scratch directory (TEST_TMPDIR under Bazel).
const std::string& ScratchDir() {
  static const std::string dir = [] {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string d = std::string(base ? base : "/tmp") + "/sg_fuzz_" + std::to_string(getpid());
    mkdir(d.c_str(), 0755);
    return d;
  }();
  return dir;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Tensors of an accepted file are read too, when small: offsets and sizes must stay inside the mapping.
void ReadSmallTensors(const io::SafetensorsFile& file) {
  for (const io::TensorInfo& t : file.tensors()) {
    if (t.numel > (1 << 16)) continue;
    std::vector<double> out(static_cast<size_t>(t.numel));
    (void)file.ReadAs(t.name, DType::kF64, out.data(), out.size());
  }
}

}  // namespace

int FuzzConfig(const uint8_t* data, size_t size) {
  const std::string text = Text(data, size);
  if (absl::StatusOr<TransformerConfig> c = io::ParseTransformerConfig(text, "fuzz/config.json"); c.ok())
    (void)Footprint(*c, DType::kF32);
  if (absl::StatusOr<MambaConfig> c = io::ParseMambaConfig(text, "fuzz/config.json"); c.ok())
    (void)Footprint(*c, DType::kF64);
  (void)io::ReadConfigModelType(text, "fuzz/config.json");
  return 0;
}

int FuzzSafetensors(const uint8_t* data, size_t size) {
  absl::StatusOr<io::SafetensorsFile> file = io::SafetensorsFile::FromBytes(Text(data, size), "fuzz.safetensors");
  if (file.ok()) ReadSmallTensors(*file);
  return 0;
}

int FuzzIndex(const uint8_t* data, size_t size) {
  // Two fixed shards; the input is the index that maps tensor names to them.
  static const std::string dir = [] {
    const std::string d = ScratchDir() + "/index";
    mkdir(d.c_str(), 0755);
    const std::vector<float> values(8, 1.0f);
    (void)io::WriteSafetensors(d + "/shard-1.safetensors",
                               {{"a", DType::kF32, {2}, values.data()}, {"b", DType::kF32, {3}, values.data()}});
    (void)io::WriteSafetensors(d + "/shard-2.safetensors", {{"c", DType::kF32, {1}, values.data()}});
    return d;
  }();
  WriteFile(dir + "/model.safetensors.index.json", Text(data, size));
  absl::StatusOr<io::ShardedSafetensors> files = io::ShardedSafetensors::OpenDir(dir);
  if (files.ok())
    for (const io::SafetensorsFile& shard : files->shards()) ReadSmallTensors(shard);
  return 0;
}

int FuzzJsonl(const uint8_t* data, size_t size) {
  const std::string path = ScratchDir() + "/data.jsonl";
  WriteFile(path, Text(data, size));
  constexpr int64_t kVocab = 1000, kMaxLine = 1 << 16;
  (void)LoadJsonl(path, /*seq_len=*/64, kVocab, kMaxLine);
  (void)LoadDpoJsonl(path, kVocab, kMaxLine);
  (void)LoadGrpoJsonl(path, kVocab, kMaxLine);
  return 0;
}

}  // namespace sg::fuzz
