// Deterministic mutation fuzzing of the safetensors reader/writer and the
// config.json parser. Run under --config=asan, where a stray read or UB
// aborts the test; the assertions themselves only demand that every input
// yields a result, plus a few round-trip properties of accepted inputs.
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "core/models/transformer/config.h"
#include "core/io/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace sg::io {
namespace {

using nlohmann::json;

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kBF16,
                                DType::kF16, DType::kI32, DType::kI64};

class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}

  // Uniform in [0, n); n > 0.
  uint64_t Below(uint64_t n) { return engine_() % n; }
  bool OneIn(uint64_t n) { return Below(n) == 0; }
  template <typename T>
  const T& Pick(const std::vector<T>& items) { return items[Below(items.size())]; }

  std::string Bytes(size_t size) {
    std::string bytes(size, '\0');
    for (char& c : bytes) c = static_cast<char>(Below(256));
    return bytes;
  }

  // Numbers chosen to hit boundaries: sign, int32/int64/uint64 limits,
  // doubles beyond every integer type.
  json InterestingNumber() {
    switch (Below(14)) {
      case 0: return 0;
      case 1: return 1;
      case 2: return -1;
      case 3: return Below(64);
      case 4: return static_cast<int64_t>(Below(1 << 20)) - (1 << 19);
      case 5: return uint64_t{1} << Below(64);
      case 6: return std::numeric_limits<int64_t>::max();
      case 7: return std::numeric_limits<int64_t>::min();
      case 8: return std::numeric_limits<uint64_t>::max();
      case 9: return 1e300;
      case 10: return -1e300;
      case 11: return 0.5;
      case 12: return 4294967296.0;
      default: return engine_();
    }
  }

  json Value(int depth = 0) {
    const uint64_t kind = depth > 3 ? Below(5) : Below(7);
    switch (kind) {
      case 0: return nullptr;
      case 1: return OneIn(2);
      case 2: return InterestingNumber();
      case 3: return Pick(std::vector<std::string>{"F32", "BF16", "F16", "F64", "I64", "U8",
                                                   "BOOL", "llama", "qwen2", "llama3", "silu",
                                                   "", "yarn", "default"});
      case 4: {
        json array = json::array();
        for (uint64_t i = Below(4); i > 0; --i) array.push_back(InterestingNumber());
        return array;
      }
      case 5: {
        json array = json::array();
        for (uint64_t i = Below(4); i > 0; --i) array.push_back(Value(depth + 1));
        return array;
      }
      default: {
        json object = json::object();
        for (uint64_t i = Below(4); i > 0; --i) object[ValidUtf8Name()] = Value(depth + 1);
        return object;
      }
    }
  }

  // Deeply nested arrays as text, which recursive parsers, copies and
  // destructors overflow the stack on. (Built as text because nlohmann's own
  // dump() is recursive.)
  std::string DeepNesting() {
    const size_t depth = 1 + Below(20000);
    return std::string(depth, '[') + std::string(depth, ']');
  }

  std::string ValidUtf8Name() {
    return Pick(std::vector<std::string>{"a", "w", "model.embed_tokens.weight", "\xc3\xa9",
                                         "__metadata__", "", "x.y.z", "\xe2\x82\xac"}) +
           std::to_string(Below(4));
  }

 private:
  std::mt19937_64 engine_;
};

std::string WithHeader(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + data;
}

// Valid files with every dtype, scalars, empty tensors and metadata.
std::vector<std::string> SeedFiles() {
  static const std::vector<uint8_t> payload(256, 0x3c);
  const std::vector<std::vector<TensorToWrite>> layouts = {
      {{"w", DType::kF32, {2, 3}, payload.data()}},
      {{"a", DType::kBF16, {4}, payload.data()},
       {"b", DType::kF16, {2, 2}, payload.data()},
       {"c", DType::kF64, {}, payload.data()}},
      {{"model.layers.0.self_attn.q_proj.weight", DType::kF32, {4, 4}, payload.data()},
       {"empty", DType::kF32, {0, 7}, nullptr},
       {"steps", DType::kI64, {3}, payload.data()},
       {"ids", DType::kI32, {1, 1, 2}, payload.data()}},
  };
  std::vector<std::string> seeds;
  for (const auto& layout : layouts) {
    absl::StatusOr<std::string> bytes = SerializeSafetensors(layout, {{"step", "3"}});
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    seeds.push_back(*bytes);
  }
  // Hand-written headers with dtypes the writer does not produce.
  seeds.push_back(WithHeader(
      R"({"i8": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
          "u8": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]},
          "flag": {"dtype": "BOOL", "shape": [1], "data_offsets": [5, 6]},
          "i16": {"dtype": "I16", "shape": [1], "data_offsets": [6, 8]}})",
      std::string(8, '\x01')));
  return seeds;
}

// Splits a file into header JSON and data section; the seeds always split.
void SplitFile(const std::string& file, json* header, std::string* data) {
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(file[i]);
  *header = json::parse(file.substr(8, length));
  *data = file.substr(8 + length);
}

// Rewrites one part of the header with a random value, then reassembles the
// file with a consistent (or deliberately inconsistent) length prefix.
std::string MutateHeaderJson(const std::string& seed, Random& random) {
  json header;
  std::string data;
  SplitFile(seed, &header, &data);
  std::vector<std::string> keys;
  for (auto it = header.begin(); it != header.end(); ++it) keys.push_back(it.key());
  const std::string key = random.Pick(keys);
  switch (random.Below(8)) {
    case 0:
      header[key] = random.Value();
      break;
    case 1:
      header.erase(key);
      break;
    case 2:
      header[random.ValidUtf8Name()] = {{"dtype", random.Value()},
                                        {"shape", random.Value()},
                                        {"data_offsets", random.Value()}};
      break;
    default: {
      if (!header[key].is_object()) break;
      const std::string field =
          random.Pick(std::vector<std::string>{"dtype", "shape", "data_offsets", "extra"});
      if (random.OneIn(5)) {
        header[key].erase(field);
      } else if (field == "data_offsets" && random.OneIn(2) &&
                 header[key][field].is_array() && header[key][field].size() == 2) {
        // Nudge a valid offset so it lands just off the expected value.
        const size_t index = random.Below(2);
        header[key][field][index] = static_cast<int64_t>(header[key][field][index].get<uint64_t>()) +
                                    static_cast<int64_t>(random.Below(17)) - 8;
      } else if (field == "shape" && random.OneIn(2)) {
        json shape = json::array();
        for (uint64_t i = random.Below(5); i > 0; --i) shape.push_back(random.InterestingNumber());
        header[key][field] = shape;
      } else {
        header[key][field] = random.Value();
      }
    }
  }
  if (random.OneIn(3)) data.resize(random.Below(data.size() + 32), '\x7f');
  return WithHeader(header.dump(), data);
}

std::string MutateBytes(std::string file, Random& random) {
  for (uint64_t round = 1 + random.Below(3); round > 0; --round) {
    switch (random.Below(7)) {
      case 0:  // flip bits anywhere
        for (uint64_t i = 1 + random.Below(4); i > 0 && !file.empty(); --i) {
          file[random.Below(file.size())] ^= static_cast<char>(1 << random.Below(8));
        }
        break;
      case 1:  // overwrite a byte inside the header text
        if (file.size() > 8) {
          file[8 + random.Below(file.size() - 8)] = random.Pick(std::vector<char>{
              '{', '}', '[', ']', '"', ',', ':', '-', '9', '\0', '\xff', '\\', ' '});
        }
        break;
      case 2:
        file.resize(random.Below(file.size() + 1));
        break;
      case 3:
        file += random.Bytes(random.Below(64));
        break;
      case 4: {  // replace the length prefix
        const uint64_t size = file.size();
        const uint64_t lengths[] = {0, 1, size - 8, size - 7, size, uint64_t{1} << 63,
                                    std::numeric_limits<uint64_t>::max(), 100'000'001,
                                    random.Below(size + 16)};
        const uint64_t length = lengths[random.Below(std::size(lengths))];
        if (file.size() < 8) file.resize(8);
        for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((length >> (8 * i)) & 0xff);
        break;
      }
      case 5:  // insert bytes
        file.insert(random.Below(file.size() + 1), random.Bytes(1 + random.Below(8)));
        break;
      default:  // erase bytes
        if (!file.empty()) file.erase(random.Below(file.size()), 1 + random.Below(8));
    }
  }
  return file;
}

// Reads every tensor of an accepted file into every type, with right and
// wrong shapes and counts.
void ExerciseFile(const SafetensorsFile& file) {
  for (const TensorInfo& info : file.tensors()) {
    ASSERT_EQ(info.bytes.size(), info.data_end - info.data_begin);
    ASSERT_EQ(file.Find(info.name), &info);
    std::vector<uint64_t> buffer(static_cast<size_t>(info.numel) + 1);
    for (DType target : kAllDTypes) {
      (void)file.ReadAs(info.name, target, buffer.data(), static_cast<size_t>(info.numel));
      (void)file.ReadAs(info.name, target, buffer.data(), static_cast<size_t>(info.numel) + 1);
    }
    (void)file.ReadInto(info.name, info.shape, DType::kF32, buffer.data());
    std::vector<int64_t> wrong_shape = info.shape;
    wrong_shape.push_back(1);
    (void)file.ReadInto(info.name, wrong_shape, DType::kF32, buffer.data());
  }
}

std::string ScratchDir(const std::string& name) {
  std::string dir = ::testing::TempDir();
  if (dir.empty() || dir.back() != '/') dir += '/';
  dir += name;
  mkdir(dir.c_str(), 0755);
  return dir;
}

TEST(FuzzIoTest, SafetensorsReaderSurvivesMutations) {
  Random random(20240611);
  const std::vector<std::string> seeds = SeedFiles();
  const std::string disk_path = ScratchDir("fuzz_safetensors") + "/model.safetensors";
  int accepted = 0;
  constexpr int kCases = 8000;
  for (int i = 0; i < kCases; ++i) {
    std::string file;
    switch (random.Below(4)) {
      case 0: file = MutateHeaderJson(random.Pick(seeds), random); break;
      case 1: file = MutateBytes(random.Pick(seeds), random); break;
      case 2: file = MutateBytes(MutateHeaderJson(random.Pick(seeds), random), random); break;
      default:
        if (random.OneIn(40)) {
          file = WithHeader(R"({"w": {"dtype": "F32", "shape": )" + random.DeepNesting() +
                                R"(, "data_offsets": [0, 0]}})",
                            "");
          break;
        }
        file = random.OneIn(2) ? WithHeader(random.Value().dump(), random.Bytes(random.Below(40)))
                               : random.Bytes(random.Below(64));
    }
    absl::StatusOr<SafetensorsFile> parsed = SafetensorsFile::FromBytes(file, "fuzz.safetensors");
    if (parsed.ok()) {
      ++accepted;
      ExerciseFile(*parsed);
    } else {
      ASSERT_EQ(std::string(parsed.status().message()).rfind("fuzz.safetensors: ", 0), 0)
          << parsed.status();
    }
    if (i % 50 == 0) {  // the mmap path, on a real file
      std::ofstream(disk_path, std::ios::binary | std::ios::trunc) << file;
      absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(disk_path);
      ASSERT_EQ(opened.ok(), parsed.ok()) << opened.status() << " vs " << parsed.status();
      if (opened.ok()) ExerciseFile(*opened);
    }
  }
  // Keeps the generator honest: some mutants must survive validation.
  EXPECT_GT(accepted, kCases / 50);
}

TEST(FuzzIoTest, WrittenFilesAlwaysReadBack) {
  Random random(77);
  std::vector<uint8_t> payload(4096);
  for (uint8_t& byte : payload) byte = static_cast<uint8_t>(random.Below(256));
  for (int i = 0; i < 1500; ++i) {
    std::vector<TensorToWrite> tensors;
    for (uint64_t t = random.Below(5); t > 0; --t) {
      TensorToWrite tensor;
      // Names include arbitrary bytes, which the writer must reject or store.
      tensor.name = random.OneIn(4) ? random.Bytes(1 + random.Below(6)) : random.ValidUtf8Name();
      tensor.dtype = kAllDTypes[random.Below(std::size(kAllDTypes))];
      for (uint64_t d = random.Below(4); d > 0; --d) {
        tensor.shape.push_back(static_cast<int64_t>(random.Below(9)));
      }
      tensor.data = payload.data();
      tensors.push_back(tensor);
    }
    absl::StatusOr<std::string> bytes = SerializeSafetensors(
        tensors, {{"k", random.OneIn(4) ? random.Bytes(3) : std::string("v")}});
    if (!bytes.ok()) continue;
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(*bytes, "written");
    ASSERT_TRUE(file.ok()) << file.status();
    for (const TensorToWrite& tensor : tensors) {
      const TensorInfo* info = file->Find(tensor.name);
      ASSERT_NE(info, nullptr) << tensor.name;
      ASSERT_EQ(info->shape, tensor.shape);
      std::vector<uint8_t> read(info->bytes.size() + 1);
      ASSERT_TRUE(
          file->ReadAs(tensor.name, tensor.dtype, read.data(), static_cast<size_t>(info->numel))
              .ok());
      ASSERT_EQ(std::memcmp(read.data(), payload.data(), info->bytes.size()), 0) << tensor.name;
    }
  }
}

TEST(FuzzIoTest, ShardIndexSurvivesMutations) {
  Random random(99);
  const std::string dir = ScratchDir("fuzz_sharded");
  const std::vector<float> values(8, 1.0f);
  ASSERT_TRUE(WriteSafetensors(dir + "/shard-1.safetensors",
                               {{"a", DType::kF32, {2}, values.data()},
                                {"b", DType::kF32, {3}, values.data()}})
                  .ok());
  ASSERT_TRUE(
      WriteSafetensors(dir + "/shard-2.safetensors", {{"c", DType::kF32, {1}, values.data()}})
          .ok());
  const json good = {{"weight_map",
                      {{"a", "shard-1.safetensors"},
                       {"b", "shard-1.safetensors"},
                       {"c", "shard-2.safetensors"}}}};
  const std::vector<std::string> shard_names = {"shard-1.safetensors", "shard-2.safetensors",
                                                "shard-3.safetensors", "", "..", "/etc/passwd",
                                                "shard-1.safetensors/"};
  for (int i = 0; i < 300; ++i) {
    json index = good;
    std::string text;
    switch (random.Below(4)) {
      case 0:
        index["weight_map"][random.Pick(std::vector<std::string>{"a", "b", "c", "d"})] =
            random.OneIn(2) ? json(random.Pick(shard_names)) : random.Value();
        text = index.dump();
        break;
      case 1:
        index["weight_map"].erase(random.Pick(std::vector<std::string>{"a", "b", "c"}));
        text = index.dump();
        break;
      case 2:
        index[random.OneIn(2) ? "weight_map" : "metadata"] = random.Value();
        text = index.dump();
        break;
      default:
        text = MutateBytes(good.dump(), random);
    }
    std::ofstream(dir + "/model.safetensors.index.json", std::ios::trunc) << text;
    absl::StatusOr<ShardedSafetensors> checkpoint = ShardedSafetensors::OpenDir(dir);
    if (!checkpoint.ok()) continue;
    for (const std::string& name : checkpoint->TensorNames()) {
      const TensorInfo* info = checkpoint->Find(name);
      ASSERT_NE(info, nullptr) << name;
      std::vector<double> buffer(static_cast<size_t>(info->numel));
      ASSERT_TRUE(checkpoint->ReadInto(name, info->shape, DType::kF64, buffer.data()).ok());
    }
  }
}

constexpr char kSeedLlamaConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": true,
  "attention_bias": false, "mlp_bias": false,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})";

constexpr char kSeedQwen2Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "vocab_size": 151, "hidden_size": 56, "num_hidden_layers": 3, "num_attention_heads": 14,
  "num_key_value_heads": 2, "intermediate_size": 48, "rms_norm_eps": 1e-06,
  "max_position_embeddings": 32768, "tie_word_embeddings": false, "use_sliding_window": false,
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "layer_types": ["full_attention", "full_attention", "full_attention"]})";

TEST(FuzzIoTest, ConfigParserSurvivesMutations) {
  Random random(4242);
  const std::vector<json> seeds = {json::parse(kSeedLlamaConfig), json::parse(kSeedQwen2Config)};
  const std::vector<std::string> fields = {
      "architectures", "model_type", "hidden_act", "vocab_size", "hidden_size",
      "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
      "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
      "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "rope_scaling",
      "rope_parameters", "layer_types"};
  const std::vector<std::string> rope_fields = {"rope_type", "type", "rope_theta", "factor",
                                                "low_freq_factor",
                                                "high_freq_factor",
                                                "original_max_position_embeddings"};
  int accepted = 0;
  constexpr int kCases = 8000;
  for (int i = 0; i < kCases; ++i) {
    json config = random.Pick(seeds);
    std::string text;
    for (uint64_t round = 1 + random.Below(3); round > 0; --round) {
      const std::string& field = random.Pick(fields);
      switch (random.Below(6)) {
        case 0: config.erase(field); break;
        case 1: config[field] = random.InterestingNumber(); break;
        case 2: {
          const char* block = random.OneIn(2) ? "rope_scaling" : "rope_parameters";
          if (config[block].is_object()) {
            config[block][random.Pick(rope_fields)] = random.Value();
          } else {
            config[block] = {{"rope_type", "llama3"}};
          }
          break;
        }
        default: config[field] = random.Value();
      }
    }
    text = config.dump();
    if (random.OneIn(4)) text = MutateBytes(text, random);
    if (random.OneIn(20)) text = random.Value().dump();
    if (random.OneIn(100)) {
      text = R"({"model_type": "llama", "architectures": )" + random.DeepNesting() + "}";
    }

    absl::StatusOr<TransformerConfig> parsed = ParseTransformerConfig(text, "fuzz.json");
    if (!parsed.ok()) {
      ASSERT_EQ(std::string(parsed.status().message()).rfind("fuzz.json: ", 0), 0)
          << parsed.status();
      continue;
    }
    ++accepted;
    // Whatever is accepted must survive a write/read cycle unchanged.
    absl::StatusOr<TransformerConfig> reread =
        ParseTransformerConfig(TransformerConfigToHFJson(*parsed), "written.json");
    ASSERT_TRUE(reread.ok()) << reread.status() << "\nfrom: " << text;
    ASSERT_EQ(reread->num_kv_heads, parsed->num_kv_heads);
    ASSERT_EQ(reread->head_dim, parsed->head_dim);
    ASSERT_EQ(reread->rope_scaling.type, parsed->rope_scaling.type);
    ASSERT_EQ(reread->rope_theta, parsed->rope_theta);
  }
  EXPECT_GT(accepted, kCases / 50);
}

}  // namespace
}  // namespace sg::io
