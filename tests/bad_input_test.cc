// Bad inputs against the engine's C++ API (issue 22): each gives a clear error naming the file, field or argument,
// within a time and memory bound; never a crash, a hang or a silently wrong value. The C ABI's cases are in
// bad_input_c_test.c, the command line's in bad_input_cli_test.py.
#include <filesystem>
#include <ios>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/checked.h"
#include "base/tensor.h"
#include "core/checkpoint.h"
#include "core/data.h"
#include "core/models/transformer/config.h"
#include "core/io/safetensors.h"
#include "core/kv_pages.h"
#include "core/model_io.h"
#include "core/strategy.h"
#include "core/trainer.h"
#include "gtest/gtest.h"
#include "tests/bad_input_support.h"

namespace sg {
namespace {

using ::sg::testing::Bounded;
using ::sg::testing::MakeFifo;
using ::sg::testing::ReleaseFifo;
using ::sg::testing::TmpDir;
using ::sg::testing::WriteFile;

constexpr int64_t kMiB = 1 << 20;

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

// A model directory holding only config.json.
std::string ConfigDir(const std::string& name, const std::string& config) {
  const std::string dir = TmpDir(name);
  WriteFile(dir + "/config.json", config);
  return dir;
}

std::string Mamba(const std::string& extra) {
  return absl::StrCat(R"({"model_type": "mamba", "vocab_size": 97, "num_hidden_layers": 2, )", extra, "}");
}
std::string Llama(const std::string& extra) {
  return absl::StrCat(R"({"model_type": "llama", "hidden_act": "silu", "num_attention_heads": 4, )",
                      R"("num_key_value_heads": 2, "intermediate_size": 64, )", extra, "}");
}

struct ConfigCase {
  std::string name;
  std::string config;
  absl::StatusCode code;
  std::vector<std::string> says;  // besides the config file's path
};

// Configurations whose sizes overflow or exceed any machine: refused before anything is allocated.
TEST(BadConfig, RefusedBeforeAllocating) {
  const std::vector<ConfigCase> cases = {
      {"mamba_hidden_2e62", Mamba(R"("hidden_size": 4611686018427387904, "expand": 1)"),
       absl::StatusCode::kInvalidArgument, {"overflows"}},
      {"mamba_state_2e62", Mamba(R"("hidden_size": 16, "state_size": 4611686018427387904)"), absl::StatusCode::kInvalidArgument,
       {"state_size", "overflows"}},
      {"mamba_expand_overflow", Mamba(R"("hidden_size": 4611686018427387904, "expand": 4)"),
       absl::StatusCode::kInvalidArgument, {"'expand'", "overflows"}},
      {"llama_vocab_2e61", Llama(R"("vocab_size": 2305843009213693952, "hidden_size": 64, "num_hidden_layers": 2)"),
       absl::StatusCode::kInvalidArgument, {"vocab_size", "more than the engine supports"}},
      {"llama_vocab_1e12", Llama(R"("vocab_size": 1000000000000, "hidden_size": 64, "num_hidden_layers": 2)"),
       absl::StatusCode::kInvalidArgument, {"vocab_size"}},
      {"llama_vocab_1e9", Llama(R"("vocab_size": 1000000000, "hidden_size": 4096, "num_hidden_layers": 2)"),
       absl::StatusCode::kResourceExhausted, {"bytes are available", "refused before allocating"}},
      {"llama_head_dim_2e40", Llama(R"("vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, )"
                                    R"("head_dim": 1099511627776)"),
       absl::StatusCode::kResourceExhausted, {"bytes are available"}},
      {"llama_layers_1e9", Llama(R"("vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1000000000)"),
       absl::StatusCode::kResourceExhausted, {"bytes are available"}},
      {"llama_vocab_2e40_hidden_2e30",
       Llama(R"("vocab_size": 1099511627776, "hidden_size": 1073741824, "num_hidden_layers": 2)"),
       absl::StatusCode::kInvalidArgument, {"vocab_size"}},
      {"llama_heads_x_head_dim_overflow",
       Llama(R"("vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 4611686018427387904)"),
       absl::StatusCode::kInvalidArgument, {"num_attention_heads", "head_dim", "overflows"}},
  };
  for (const ConfigCase& c : cases) {
    const std::string dir = ConfigDir("config_" + c.name, c.config);
    Bounded(c.name.c_str(), 10, 64 * kMiB, [&] {
      for (DType dtype : {DType::kF32, DType::kF64}) {
        absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(dir, dtype, 0);
        ASSERT_FALSE(m.ok()) << c.name;
        EXPECT_EQ(m.status().code(), c.code) << c.name << ": " << m.status();
        EXPECT_TRUE(Contains(m.status(), dir + "/config.json")) << c.name << ": " << m.status();
        for (const std::string& w : c.says) EXPECT_TRUE(Contains(m.status(), w)) << c.name << ": " << m.status();
      }
    });
  }
}

// The allocator itself refuses what overflows or what the host does not have, as an OutOfMemory naming the bytes.
TEST(BadSize, TensorAndPagePoolSizesAreChecked) {
  MemoryTracker mem;
  try {
    Tensor::Empty(&mem, MemCategory::kWeights, DType::kF32, {int64_t{1} << 40, int64_t{1} << 40});
    ADD_FAILURE() << "an overflowing shape was allocated";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("[1099511627776, 1099511627776]"), std::string::npos) << e.what();
  }
  try {
    Tensor::Empty(&mem, MemCategory::kActivations, DType::kF64, {int64_t{1} << 50});
    ADD_FAILURE() << "8 PiB were allocated";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("bytes available"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tensor::Empty(&mem, MemCategory::kWeights, DType::kF32, {-1, 4}), OutOfMemory);
  EXPECT_THROW(PagePool(&mem, MemCategory::kKVCache, DType::kF32, 4, int64_t{1} << 40, int64_t{1} << 20, 1 << 10),
               OutOfMemory);
  EXPECT_EQ(mem.Snapshot().total_current, 0);  // nothing counted by the refusals
  EXPECT_EQ(CheckedBytes(DType::kF32, {int64_t{1} << 62}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*CheckedBytes(DType::kF64, {3, 5}), 120);
}

// Out of memory inside a step and other exceptions become statuses that say what happened.
TEST(ExceptionStatus, MapsEachKind) {
  absl::Status s = CatchStrategyErrors("step", [] { throw std::bad_alloc(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "bytes available")) << s;
  s = CatchStrategyErrors("step", [] { throw OutOfMemory("out of memory: 123 bytes of logits asked"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "123 bytes of logits")) << s;
  s = CatchStrategyErrors("step", [] { throw std::system_error(ENOSPC, std::generic_category(), "write"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  s = CatchStrategyErrors("step", [] { throw std::ios_base::failure("read", std::error_code(EISDIR, std::generic_category())); });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;  // absl's mapping of EISDIR
  s = CatchStrategyErrors("step", [] { throw std::logic_error("bug"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "step failed: bug")) << s;
  s = CatchStrategyErrors("step", [] { throw 42; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

// FIFOs where files are expected: refused at once, never waited on.
TEST(BadFiles, FifosAreRefusedWithoutBlocking) {
  const std::string config_dir = TmpDir("fifo_config");
  const std::string config = MakeFifo(config_dir + "/config.json");
  Bounded("fifo config.json", 10, 64 * kMiB, [&] {
    absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(config_dir, DType::kF32, 0);
    ASSERT_FALSE(m.ok());
    EXPECT_TRUE(Contains(m.status(), config + ": is a FIFO")) << m.status();
  }, [&] { ReleaseFifo(config); });

  const std::string weights_dir = ConfigDir("fifo_weights", Mamba(R"("hidden_size": 16, "state_size": 4)"));
  const std::string weights = MakeFifo(weights_dir + "/model.safetensors");
  Bounded("fifo model.safetensors", 10, 64 * kMiB, [&] {
    absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(weights_dir, DType::kF32, 0);
    ASSERT_FALSE(m.ok());
    EXPECT_TRUE(Contains(m.status(), weights + ": is a FIFO")) << m.status();
  }, [&] { ReleaseFifo(weights); });

  const std::string data = MakeFifo(TmpDir("fifo_data") + "/data.jsonl");
  Bounded("fifo --data", 10, 64 * kMiB, [&] {
    for (absl::Status s : {LoadJsonl(data, 64, 100).status(), LoadDpoJsonl(data, 100).status(),
                           LoadTokenBin(data, 2, 64, 100).status()}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(Contains(s, data + ": is a FIFO")) << s;
    }
  }, [&] { ReleaseFifo(data); });

  const std::string dir = TmpDir("data_dir");
  for (absl::Status s : {LoadJsonl(dir, 64, 100).status(), LoadTokenBin(dir, 2, 64, 100).status()})
    EXPECT_TRUE(Contains(s, dir + ": is a directory")) << s;
  Bounded("/dev/zero as --data", 10, 64 * kMiB, [&] {
    for (absl::Status s : {LoadJsonl("/dev/zero", 64, 100).status(), LoadTokenBin("/dev/zero", 4, 64, 100).status()})
      EXPECT_TRUE(Contains(s, "/dev/zero: is a character device")) << s;
  });
}

// A safetensors header with many entries and JSON with many objects parse in linear time.
TEST(BadFiles, LargeJsonParsesInLinearTime) {
  auto header_with = [](int n) {
    std::string h = "{";
    for (int i = 0; i < n; ++i)
      absl::StrAppend(&h, i ? "," : "", "\"model.layers.", i, ".w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[",
                      4 * i, ",", 4 * i + 4, "]}");
    h += "}";
    h.resize((h.size() + 7) / 8 * 8, ' ');
    std::string file(8, '\0');
    for (int b = 0; b < 8; ++b) file[b] = static_cast<char>((h.size() >> (8 * b)) & 0xff);
    return file + h + std::string(4 * static_cast<size_t>(n), '\0');
  };
  const std::string dir = TmpDir("big_header");
  const std::string big = WriteFile(dir + "/big.safetensors", header_with(500000));  // ~35 MB of header
  Bounded("safetensors header of 500k entries", 60, 2048 * kMiB, [&] {
    absl::StatusOr<io::SafetensorsFile> f = io::SafetensorsFile::Open(big);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->tensors().size(), 500000);
  });
  std::string siblings = "{\"model_type\": \"llama\"";
  for (int i = 0; i < 200000; ++i) absl::StrAppend(&siblings, ",\"x", i, "\":{}");
  siblings += "}";
  Bounded("config with 200k objects", 30, 512 * kMiB, [&] {
    absl::StatusOr<TransformerConfig> c = io::ParseTransformerConfig(siblings, "many.json");
    EXPECT_TRUE(Contains(c.status(), "many.json: field 'vocab_size' is missing")) << c.status();
  });
  std::string nested;
  for (int i = 0; i < 20000; ++i) nested += "{\"a\":";
  nested += "1" + std::string(20000, '}');
  Bounded("config with 20k nested objects", 10, 64 * kMiB, [&] {
    absl::StatusOr<TransformerConfig> c = io::ParseTransformerConfig(nested, "nested.json");
    EXPECT_TRUE(Contains(c.status(), "nested.json: JSON nested deeper than 256 levels")) << c.status();
  });
  const std::string dup = WriteFile(dir + "/dup.json", R"({"vocab_size": 1, "vocab_size": 2})");
  absl::StatusOr<TransformerConfig> c = io::LoadTransformerConfig(dup);
  EXPECT_TRUE(Contains(c.status(), "duplicate JSON key 'vocab_size'")) << c.status();
}

// .bin sizes are checked against the file before anything is read.
TEST(BadData, TokenBinSizes) {
  const std::string dir = TmpDir("bin");
  absl::Status s = LoadTokenBin(WriteFile(dir + "/odd.bin", std::string(7, '\1')), 2, 4, 1000).status();
  EXPECT_TRUE(Contains(s, "odd.bin: size 7 is not a multiple of 2")) << s;
  s = LoadTokenBin(WriteFile(dir + "/big_id.bin", std::string("\x01\x00\xff\xff", 4)), 2, 4, 1000).status();
  EXPECT_TRUE(Contains(s, "big_id.bin: token id 65535 at index 1 is outside the vocabulary [0, 1000)")) << s;
}

struct JsonlCase {
  std::string name;
  std::string text;
  std::string says;  // after "<path>:"
};

// Ids and labels are read exactly; duplicate keys, NULs and over-long lines are refused naming file:line.
TEST(BadData, JsonlRecords) {
  const std::vector<JsonlCase> cases = {
      {"uint64_label", "{\"input_ids\": [1, 2, 3], \"labels\": [1, 18446744073709551516, 3]}\n",
       "1: field 'labels[1]' is 18446744073709551516: a label must be -100 (ignored) or in the vocabulary [0, 100)"},
      {"label_minus_101", "{\"input_ids\": [1, 2], \"labels\": [-101, 2]}\n", "1: field 'labels[0]' is -101"},
      {"label_int32_wrap", "{\"input_ids\": [1, 2], \"labels\": [4294967196, 2]}\n", "1: field 'labels[0]' is 4294967196"},
      {"float_label", "{\"input_ids\": [1, 2], \"labels\": [1.0, 2]}\n", "1: field 'labels[0]' must be an integer label"},
      {"negative_id", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, -5, 4]}\n",
       "2: field 'input_ids[1]' is -5, outside the vocabulary [0, 100)"},
      {"id_minus_100", "{\"input_ids\": [-100, 2]}\n", "1: field 'input_ids[0]' is -100, outside"},
      {"huge_id", "{\"input_ids\": [1, 18446744073709551615]}\n", "1: field 'input_ids[1]' is 18446744073709551615"},
      {"duplicate_key", "{\"input_ids\": [1, 2], \"input_ids\": [3, 4]}\n", "1: duplicate JSON key 'input_ids'"},
      {"duplicate_labels", "\n{\"input_ids\": [1, 2], \"labels\": [1, 2], \"labels\": [3, 4]}\n",
       "2: duplicate JSON key 'labels'"},
      {"nul", std::string("{\"input_ids\": [1, 2]}\0{\"input_ids\": [500]}\n", 42), "1: NUL byte at column 22"},
      {"label_count", "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}\n", "1: field 'labels' has 2 labels for 3 input ids"},
      {"one_id", "{\"input_ids\": [7]}\n", "1: field 'input_ids' has fewer than 2 input ids"},
  };
  const std::string dir = TmpDir("jsonl");
  for (const JsonlCase& c : cases) {
    const std::string path = WriteFile(dir + "/" + c.name + ".jsonl", c.text);
    absl::Status s = LoadJsonl(path, 64, 100).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_TRUE(Contains(s, path + ":" + c.says)) << c.name << ": " << s;
    if (c.name == "negative_id") {
      EXPECT_FALSE(Contains(s, "label")) << s;
    }
  }
  const std::string dpo = WriteFile(dir + "/dpo_dup.jsonl", R"({"prompt": [1], "chosen": [2], "chosen": [3], "rejected": [4]})");
  EXPECT_TRUE(Contains(LoadDpoJsonl(dpo, 100).status(), dpo + ":1: duplicate JSON key 'chosen'"));
}

// A line longer than the limit is refused after reading at most the limit, in bounded memory.
TEST(BadData, JsonlLineLimit) {
  std::string line = "{\"input_ids\": [1";
  while (line.size() < 64 * kMiB) line += ", 1";
  line += "]}\n";
  const std::string path = WriteFile(TmpDir("long_line") + "/long.jsonl", "{\"input_ids\": [1, 2]}\n" + line);
  line.clear();
  line.shrink_to_fit();
  Bounded("64 MiB line, limit 1 MiB", 20, 16 * kMiB, [&] {
    absl::Status s = LoadJsonl(path, 64, 100, /*max_line_bytes=*/kMiB).status();
    EXPECT_TRUE(Contains(s, path + ":2: line is longer than 1048576 bytes (--max_line_bytes)")) << s;
  });
  Bounded("64 MiB line, default limit", 20, 16 * kMiB, [&] {
    absl::Status s = LoadJsonl(path, 64, 100).status();
    EXPECT_TRUE(Contains(s, path + ":2: line is longer than 67108864 bytes")) << s;
  });
}

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = 1 + i % 50;
  return t;
}

// Rotation keeps the newest valid checkpoints; an invalid one is moved aside and never costs a valid one.
TEST(Checkpoints, RotationKeepsValidOnes) {
  namespace fs = std::filesystem;
  const std::string out = TmpDir("rotation");
  absl::StatusOr<std::unique_ptr<Model>> model = LoadAnyModel("tiny", DType::kF32, 1);
  ASSERT_TRUE(model.ok()) << model.status();
  Trainer trainer(**model, StrategyOptions{}, {});
  Sequence seq;
  seq.ids = Tokens(16);
  seq.labels = Tokens(16);
  auto save = [&](int keep) {
    absl::StatusOr<StepMetrics> m = trainer.Step({seq});
    ASSERT_TRUE(m.ok()) << m.status();
    CheckpointMeta meta;
    meta.trainer = trainer.state();
    meta.run_config = TrainerRunConfig(trainer);
    absl::StatusOr<std::string> dir = SaveCheckpoint(out, trainer, meta, keep);
    ASSERT_TRUE(dir.ok()) << dir.status();
  };
  save(0);  // checkpoint-1
  save(0);  // checkpoint-2
  // checkpoint-9 whose state says step 1, and a checkpoint-8 with a truncated file: both invalid.
  fs::copy(out + "/checkpoint-1", out + "/checkpoint-9", fs::copy_options::recursive);
  fs::copy(out + "/checkpoint-1", out + "/checkpoint-8", fs::copy_options::recursive);
  fs::resize_file(out + "/checkpoint-8/model.safetensors", 100);
  save(2);  // checkpoint-3: keeps 3 and 2
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-2", "checkpoint-3", "invalid-checkpoint-8",
                                             "invalid-checkpoint-9"}));
  absl::StatusOr<std::string> latest = FindLatestCheckpoint(out);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, out + "/checkpoint-3");
}

}  // namespace
}  // namespace sg
