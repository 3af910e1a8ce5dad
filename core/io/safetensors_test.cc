#include "core/io/safetensors.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "core/io/file.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace sg::io {
namespace {

// A fresh directory per test, under the test runner's scratch space.
std::string TestDir() {
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string dir = ::testing::TempDir();
  if (dir.empty() || dir.back() != '/') dir += '/';
  dir += std::string(test->test_suite_name()) + "." + test->name();
  mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* handle = opendir(dir.c_str());
  while (dirent* entry = readdir(handle)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(handle);
  return names;
}

// A file with `header` verbatim (not padded) and `data_size` zero bytes.
std::string RawFile(const std::string& header, size_t data_size) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + std::string(data_size, '\0');
}

// Writes `contents` as model.safetensors in a fresh directory and opens it.
absl::Status OpenRaw(const std::string& contents) {
  const std::string path = TestDir() + "/model.safetensors";
  WriteFile(path, contents);
  return SafetensorsFile::Open(path).status();
}

void ExpectErrorMentions(const absl::Status& status, const std::vector<std::string>& parts) {
  ASSERT_FALSE(status.ok()) << "expected an error mentioning '" << parts.front() << "'";
  const std::string message(status.message());
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "error message lacks '" << part << "': " << message;
  }
}

TEST(SafetensorsTest, RoundTripF32AndMetadata) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<float> weight = {1.5f, -2.0f, 3.25f, 0.0f, 1e-20f, -7.0f};
  const std::vector<float> bias = {0.5f, 0.25f};
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"layer.weight", DType::kF32, {2, 3}, weight.data()},
                                {"layer.bias", DType::kF32, {2}, bias.data()}},
                               {{"step", "12"}})
                  .ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 2);
  EXPECT_EQ(file->tensors()[0].name, "layer.weight");  // data-section order
  EXPECT_EQ(file->tensors()[0].dtype, StDType::kF32);
  EXPECT_EQ(file->tensors()[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(file->tensors()[0].numel, 6);
  EXPECT_EQ(file->tensors()[0].data_begin, 0);
  EXPECT_EQ(file->tensors()[0].data_end, 24);
  EXPECT_EQ(file->tensors()[0].bytes.size(), 24);
  EXPECT_EQ(file->tensors()[1].data_begin, 24);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("step"), "12");
  EXPECT_EQ(file->Find("missing"), nullptr);
  ASSERT_NE(file->Find("layer.bias"), nullptr);

  std::vector<float> read(6);
  ASSERT_TRUE(file->ReadInto("layer.weight", {2, 3}, DType::kF32, read.data()).ok());
  EXPECT_EQ(read, weight);
  std::vector<double> read_f64(2);
  ASSERT_TRUE(file->ReadAs("layer.bias", DType::kF64, read_f64.data(), 2).ok());
  EXPECT_EQ(read_f64, (std::vector<double>{0.5, 0.25}));
}

TEST(SafetensorsTest, RoundTripF64) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<double> values = {1.0 / 3.0, -1e300, 2.5};
  ASSERT_TRUE(WriteSafetensors(path, {{"x", DType::kF64, {3}, values.data()}}).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("x")->dtype, StDType::kF64);
  std::vector<double> exact(3);
  ASSERT_TRUE(file->ReadInto("x", {3}, DType::kF64, exact.data()).ok());
  EXPECT_EQ(exact, values);
  std::vector<float> narrowed(3);
  ASSERT_TRUE(file->ReadInto("x", {3}, DType::kF32, narrowed.data()).ok());
  EXPECT_EQ(narrowed[0], static_cast<float>(1.0 / 3.0));
  EXPECT_EQ(narrowed[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(narrowed[2], 2.5f);
}

TEST(SafetensorsTest, RoundTripBF16) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<float> source = {1.0f, -3.140625f, 1e30f, 0.0078125f};
  std::vector<uint16_t> bf16;
  for (float v : source) bf16.push_back(F32ToBF16(v));
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kBF16, {2, 2}, bf16.data()}}).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("w")->dtype, StDType::kBF16);
  std::vector<uint16_t> copied(4);
  ASSERT_TRUE(file->ReadInto("w", {2, 2}, DType::kBF16, copied.data()).ok());
  EXPECT_EQ(copied, bf16);
  std::vector<float> widened(4);
  ASSERT_TRUE(file->ReadInto("w", {2, 2}, DType::kF32, widened.data()).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(widened[i], BF16ToF32(bf16[i]));
}

TEST(SafetensorsTest, RoundTripF16) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<float> source = {1.0f, -65504.0f, 6e-8f, 0.333f};
  std::vector<uint16_t> f16;
  for (float v : source) f16.push_back(F32ToF16(v));
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kF16, {4}, f16.data()}}).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("w")->dtype, StDType::kF16);
  std::vector<uint16_t> copied(4);
  ASSERT_TRUE(file->ReadInto("w", {4}, DType::kF16, copied.data()).ok());
  EXPECT_EQ(copied, f16);
  std::vector<double> widened(4);
  ASSERT_TRUE(file->ReadInto("w", {4}, DType::kF64, widened.data()).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(widened[i], F16ToF32(f16[i]));
  // f32 -> bf16 through the reader, rounding once.
  std::vector<uint16_t> as_bf16(4);
  ASSERT_TRUE(file->ReadInto("w", {4}, DType::kBF16, as_bf16.data()).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(as_bf16[i], F32ToBF16(F16ToF32(f16[i])));
}

TEST(SafetensorsTest, ScalarsEmptyTensorsAndIntegers) {
  const std::string path = TestDir() + "/model.safetensors";
  const float scalar = 42.0f;
  const std::vector<int64_t> steps = {7, -1};
  ASSERT_TRUE(WriteSafetensors(path, {{"scalar", DType::kF32, {}, &scalar},
                                      {"empty", DType::kF32, {0, 4}, nullptr},
                                      {"steps", DType::kI64, {2}, steps.data()}})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  float read_scalar = 0;
  ASSERT_TRUE(file->ReadInto("scalar", {}, DType::kF32, &read_scalar).ok());
  EXPECT_EQ(read_scalar, 42.0f);
  EXPECT_TRUE(file->ReadInto("empty", {0, 4}, DType::kF32, nullptr).ok());
  std::vector<int64_t> read_steps(2);
  ASSERT_TRUE(file->ReadInto("steps", {2}, DType::kI64, read_steps.data()).ok());
  EXPECT_EQ(read_steps, steps);
  std::vector<float> as_float(2);
  ExpectErrorMentions(file->ReadInto("steps", {2}, DType::kF32, as_float.data()),
                      {"model.safetensors", "'steps'", "I64", "f32"});
}

TEST(SafetensorsTest, WriterLayoutIsHuggingFaceCompatible) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<float> values = {1, 2, 3};
  ASSERT_TRUE(WriteSafetensors(path, {{"a", DType::kF32, {3}, values.data()}}).ok());
  const std::string bytes = ReadFile(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0);
  EXPECT_EQ(bytes.size(), 8 + header_length + 12);
  const std::string header = bytes.substr(8, header_length);
  const nlohmann::json parsed = nlohmann::json::parse(header);
  EXPECT_EQ(parsed["__metadata__"], (nlohmann::json{{"format", "pt"}}));
  EXPECT_EQ(parsed["a"]["dtype"], "F32");
  EXPECT_EQ(parsed["a"]["shape"], (nlohmann::json{3}));
  EXPECT_EQ(parsed["a"]["data_offsets"], (nlohmann::json{0, 12}));
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1);
  EXPECT_EQ(bytes.substr(8 + header_length), std::string(reinterpret_cast<const char*>(values.data()), 12));
}

TEST(SafetensorsTest, WriterAlignsEveryTensorToItsElementSize) {
  const std::vector<uint16_t> odd_bf16 = {1, 2, 3};
  const std::vector<float> f32 = {4, 5};
  const std::vector<double> f64 = {6};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(
      {{"odd", DType::kBF16, {3}, odd_bf16.data()},
       {"f32", DType::kF32, {2}, f32.data()},
       {"f64", DType::kF64, {1}, f64.data()}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(*bytes, "aligned");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 3);
  EXPECT_EQ(file->tensors()[0].name, "f64");
  EXPECT_EQ(file->tensors()[1].name, "f32");
  EXPECT_EQ(file->tensors()[2].name, "odd");
  for (const TensorInfo& info : file->tensors()) {
    EXPECT_EQ(info.data_begin % StDTypeSize(info.dtype), 0) << info.name;
  }
  std::vector<uint16_t> read(3);
  ASSERT_TRUE(file->ReadInto("odd", {3}, DType::kBF16, read.data()).ok());
  EXPECT_EQ(read, odd_bf16);
  double read_f64 = 0;
  ASSERT_TRUE(file->ReadInto("f64", {1}, DType::kF64, &read_f64).ok());
  EXPECT_EQ(read_f64, 6.0);
}

TEST(SafetensorsTest, WriteReplacesAtomicallyAndLeavesNoTemporaryFile) {
  const std::string dir = TestDir();
  const std::string path = dir + "/model.safetensors";
  const float first = 1, second = 2;
  ASSERT_TRUE(WriteSafetensors(path, {{"x", DType::kF32, {1}, &first}}).ok());
  ASSERT_TRUE(WriteSafetensors(path, {{"x", DType::kF32, {1}, &second}}).ok());
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"model.safetensors"});
  float read = 0;
  ASSERT_TRUE(SafetensorsFile::Open(path)->ReadInto("x", {1}, DType::kF32, &read).ok());
  EXPECT_EQ(read, 2.0f);
}

// A writer killed before its rename leaves "<path>.tmp.<pid>" behind: the next write of the same file removes it,
// but never a temporary that a live writer holds (locked), nor a link of that name.
TEST(SafetensorsTest, WriteRemovesTemporariesOfKilledWritersOnly) {
  const std::string dir = TestDir();
  const std::string path = dir + "/adapter_model.safetensors";
  WriteFile(path + ".tmp.999999", "left by a killed writer");
  absl::StatusOr<LockedTemporary> live = LockedTemporary::Create(path + ".live");  // another writer's, running
  ASSERT_TRUE(live.ok()) << live.status();
  const std::string live_name = "adapter_model.safetensors.tmp.live";
  ASSERT_EQ(rename(live->path().c_str(), (dir + "/" + live_name).c_str()), 0);  // still locked under its new name
  WriteFile(dir + "/elsewhere", "not a temporary");
  ASSERT_EQ(symlink((dir + "/elsewhere").c_str(), (path + ".tmp.link").c_str()), 0);
  const float x = 1;
  ASSERT_TRUE(WriteSafetensors(path, {{"x", DType::kF32, {1}, &x}}).ok());
  std::vector<std::string> names = ListDir(dir);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"adapter_model.safetensors", "adapter_model.safetensors.tmp.link",
                                             live_name, "elsewhere"}));
}

TEST(SafetensorsTest, WriterRejectsBadTensors) {
  const std::string path = TestDir() + "/model.safetensors";
  const float value = 1;
  ExpectErrorMentions(WriteSafetensors(path, {{"x", DType::kF32, {1}, &value},
                                              {"x", DType::kF32, {1}, &value}}),
                      {"model.safetensors", "'x'", "twice"});
  ExpectErrorMentions(WriteSafetensors(path, {{"x", DType::kF32, {-1}, &value}}),
                      {"model.safetensors", "'x'", "negative"});
  ExpectErrorMentions(WriteSafetensors(path, {{"x", DType::kF32, {2}, nullptr}}),
                      {"model.safetensors", "'x'", "null"});
  ExpectErrorMentions(WriteSafetensors(path, {{"__metadata__", DType::kF32, {1}, &value}}),
                      {"model.safetensors", "reserved"});
  ExpectErrorMentions(WriteSafetensors(TestDir() + "/no/such/dir/model.safetensors",
                                       {{"x", DType::kF32, {1}, &value}}),
                      {"no/such/dir/model.safetensors"});
  EXPECT_EQ(ListDir(TestDir()), std::vector<std::string>{});
}

TEST(SafetensorsTest, FromBytesMatchesOpen) {
  const float value = 3;
  absl::StatusOr<std::string> bytes = SerializeSafetensors({{"x", DType::kF32, {1}, &value}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::FromBytes(*bytes, "in-memory");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->path(), "in-memory");
  float read = 0;
  ASSERT_TRUE(file->ReadInto("x", {1}, DType::kF32, &read).ok());
  EXPECT_EQ(read, 3.0f);
}

// ---- Malformed files: every error names the file and the field or tensor.

TEST(SafetensorsErrorTest, MissingFile) {
  ExpectErrorMentions(SafetensorsFile::Open(TestDir() + "/absent.safetensors").status(),
                      {"absent.safetensors", "cannot open"});
}

TEST(SafetensorsErrorTest, FileShorterThanLengthPrefix) {
  ExpectErrorMentions(OpenRaw("abc"), {"model.safetensors", "3 bytes", "header length"});
  ExpectErrorMentions(OpenRaw(""), {"model.safetensors", "0 bytes"});
}

TEST(SafetensorsErrorTest, TruncatedDataSection) {
  const std::vector<float> values(16, 1.0f);
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors({{"model.embed_tokens.weight", DType::kF32, {4, 4}, values.data()}});
  ASSERT_TRUE(bytes.ok());
  ExpectErrorMentions(OpenRaw(bytes->substr(0, bytes->size() - 10)),
                      {"model.safetensors", "tensor 'model.embed_tokens.weight'",
                       "data_offsets [0, 64) exceed data section of 54 bytes"});
}

TEST(SafetensorsErrorTest, TruncatedHeader) {
  const float value = 1;
  absl::StatusOr<std::string> bytes = SerializeSafetensors({{"x", DType::kF32, {1}, &value}});
  ASSERT_TRUE(bytes.ok());
  ExpectErrorMentions(OpenRaw(bytes->substr(0, 20)),
                      {"model.safetensors", "header length", "exceeds the 12 bytes"});
}

TEST(SafetensorsErrorTest, HeaderLengthBeyondCap) {
  std::string bytes(8, '\xff');
  bytes += "{}";
  ExpectErrorMentions(OpenRaw(bytes), {"model.safetensors", "header length 18446744073709551615",
                                       "limit"});
}

TEST(SafetensorsErrorTest, HeaderNotJson) {
  ExpectErrorMentions(OpenRaw(RawFile("{\"a\": nope}", 0)),
                      {"model.safetensors", "header", "not valid JSON", "line 1, column 8"});
  ExpectErrorMentions(OpenRaw(RawFile("{\"a\xff\": 1}", 0)),
                      {"model.safetensors", "not valid JSON"});
  ExpectErrorMentions(OpenRaw(RawFile("[1, 2]", 0)),
                      {"model.safetensors", "header must be a JSON object, got array"});
  ExpectErrorMentions(OpenRaw(RawFile("", 0)), {"model.safetensors", "not valid JSON"});
}

TEST(SafetensorsErrorTest, DuplicateKey) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                          "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                      8)),
      {"model.safetensors", "duplicate JSON key 'a'"});
}

TEST(SafetensorsErrorTest, OffsetsOutOfRange) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"model.layers.0.self_attn.q_proj.weight":
                          {"dtype": "F32", "shape": [25], "data_offsets": [0, 100]}})",
                      64)),
      {"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight': data_offsets "
       "[0, 100) exceed data section of 64 bytes"});
}

TEST(SafetensorsErrorTest, OffsetsReversedOrNegative) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8)),
      {"model.safetensors", "tensor 'w'", "[8, 4)", "begin is after end"});
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8)),
      {"model.safetensors", "tensor 'w'", "data_offsets", "-4"});
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 8)),
      {"model.safetensors", "tensor 'w'", "data_offsets", "array of 2"});
}

TEST(SafetensorsErrorTest, OverlappingTensors) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"first": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "second": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                      24)),
      {"model.safetensors", "'first' data_offsets [0, 16)", "'second' data_offsets [8, 24)",
       "overlap"});
  // An identical range is an overlap too.
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "b": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}})",
                      16)),
      {"model.safetensors", "'a'", "'b'", "overlap"});
}

TEST(SafetensorsErrorTest, UnknownDtype) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}})", 2)),
      {"model.safetensors", "tensor 'w'", "field 'dtype'", "unknown dtype 'Q4'"});
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": 4, "shape": [4], "data_offsets": [0, 2]}})", 2)),
      {"model.safetensors", "tensor 'w'", "field 'dtype' must be a string, got integer"});
}

TEST(SafetensorsErrorTest, ShapeDoesNotMatchByteSize) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})",
                      16)),
      {"model.safetensors: tensor 'w': data_offsets [0, 16) span 16 bytes but shape [2, 3] "
       "of F32 needs 24"});
}

TEST(SafetensorsErrorTest, BadShapes) {
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 0]}})", 0)),
      {"model.safetensors", "tensor 'w'", "field 'shape'", "dimension 1", "-3"});
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 0]}})", 0)),
      {"model.safetensors", "tensor 'w'", "field 'shape'", "dimension 0", "1.5"});
  ExpectErrorMentions(
      OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}})", 16)),
      {"model.safetensors", "tensor 'w'", "field 'shape' must be an array, got string"});
  ExpectErrorMentions(
      OpenRaw(RawFile(
          R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
          0)),
      {"model.safetensors", "tensor 'w'", "field 'shape'", "too large"});
}

TEST(SafetensorsErrorTest, MissingAndUnexpectedFields) {
  ExpectErrorMentions(OpenRaw(RawFile(R"({"w": {"dtype": "F32", "shape": [1]}})", 4)),
                      {"model.safetensors", "tensor 'w'", "missing field 'data_offsets'"});
  ExpectErrorMentions(
      OpenRaw(RawFile(
          R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}})", 4)),
      {"model.safetensors", "tensor 'w'", "unexpected field 'extra'"});
  ExpectErrorMentions(OpenRaw(RawFile(R"({"w": [1, 2]})", 0)),
                      {"model.safetensors", "tensor 'w'", "entry must be a JSON object"});
}

TEST(SafetensorsErrorTest, BadMetadata) {
  ExpectErrorMentions(OpenRaw(RawFile(R"({"__metadata__": {"format": 1}})", 0)),
                      {"model.safetensors", "__metadata__", "'format'", "string"});
  ExpectErrorMentions(OpenRaw(RawFile(R"({"__metadata__": []})", 0)),
                      {"model.safetensors", "__metadata__", "got array"});
}

TEST(SafetensorsErrorTest, ReadIntoWrongShapeOrCount) {
  const std::string path = TestDir() + "/model.safetensors";
  const std::vector<float> values(6, 1.0f);
  ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", DType::kF32, {2, 3}, values.data()}}).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  std::vector<float> dst(6);
  ExpectErrorMentions(file->ReadInto("lm_head.weight", {3, 2}, DType::kF32, dst.data()),
                      {"model.safetensors: tensor 'lm_head.weight': shape [2, 3] does not match "
                       "expected [3, 2]"});
  ExpectErrorMentions(file->ReadAs("lm_head.weight", DType::kF32, dst.data(), 5),
                      {"model.safetensors", "'lm_head.weight'", "5 f32 elements", "has 6"});
  ExpectErrorMentions(file->ReadInto("missing", {1}, DType::kF32, dst.data()),
                      {"model.safetensors", "no tensor named 'missing'"});
  ExpectErrorMentions(file->ReadInto("lm_head.weight", {2, 3}, DType::kF32, nullptr),
                      {"model.safetensors", "'lm_head.weight'", "null"});
}

// ---- Sharded checkpoints.

struct ShardedFixture {
  std::string dir;
  std::vector<float> a = {1, 2, 3, 4};
  std::vector<float> b = {5, 6};
  std::vector<float> c = {7};
};

// Writes shards {a, b} and {c} plus an index mapping them.
void WriteShardedCheckpoint(ShardedFixture& fixture, const nlohmann::json& weight_map) {
  ASSERT_TRUE(WriteSafetensors(fixture.dir + "/model-00001-of-00002.safetensors",
                               {{"a", DType::kF32, {2, 2}, fixture.a.data()},
                                {"b", DType::kF32, {2}, fixture.b.data()}})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(fixture.dir + "/model-00002-of-00002.safetensors",
                               {{"c", DType::kF32, {1}, fixture.c.data()}})
                  .ok());
  const nlohmann::json index = {{"metadata", {{"total_size", 28}}}, {"weight_map", weight_map}};
  WriteFile(fixture.dir + "/model.safetensors.index.json", index.dump(2));
}

const nlohmann::json kGoodWeightMap = {{"a", "model-00001-of-00002.safetensors"},
                                       {"b", "model-00001-of-00002.safetensors"},
                                       {"c", "model-00002-of-00002.safetensors"}};

TEST(ShardedSafetensorsTest, ReadsAcrossShards) {
  ShardedFixture fixture{TestDir()};
  WriteShardedCheckpoint(fixture, kGoodWeightMap);
  absl::StatusOr<ShardedSafetensors> checkpoint = ShardedSafetensors::OpenDir(fixture.dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->source(), fixture.dir + "/model.safetensors.index.json");
  EXPECT_EQ(checkpoint->shards().size(), 2);
  EXPECT_EQ(checkpoint->TensorNames(), (std::vector<std::string>{"a", "b", "c"}));
  ASSERT_NE(checkpoint->Find("c"), nullptr);
  EXPECT_EQ(checkpoint->Find("c")->shape, std::vector<int64_t>{1});
  EXPECT_EQ(checkpoint->Find("zzz"), nullptr);
  std::vector<float> a(4), c(1);
  ASSERT_TRUE(checkpoint->ReadInto("a", {2, 2}, DType::kF32, a.data()).ok());
  ASSERT_TRUE(checkpoint->ReadAs("c", DType::kF32, c.data(), 1).ok());
  EXPECT_EQ(a, fixture.a);
  EXPECT_EQ(c, fixture.c);
  ExpectErrorMentions(checkpoint->ReadInto("zzz", {1}, DType::kF32, c.data()),
                      {"model.safetensors.index.json", "no tensor named 'zzz'"});
  ExpectErrorMentions(checkpoint->ReadInto("a", {4}, DType::kF32, a.data()),
                      {"model-00001-of-00002.safetensors", "tensor 'a'", "[2, 2]", "[4]"});
}

TEST(ShardedSafetensorsTest, PrefersSingleFile) {
  const std::string dir = TestDir();
  const float value = 9;
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {{"x", DType::kF32, {1}, &value}}).ok());
  absl::StatusOr<ShardedSafetensors> checkpoint = ShardedSafetensors::OpenDir(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->source(), dir + "/model.safetensors");
  EXPECT_EQ(checkpoint->TensorNames(), std::vector<std::string>{"x"});
  float read = 0;
  ASSERT_TRUE(checkpoint->ReadInto("x", {1}, DType::kF32, &read).ok());
  EXPECT_EQ(read, 9.0f);
}

TEST(ShardedSafetensorsErrorTest, NoCheckpoint) {
  ExpectErrorMentions(ShardedSafetensors::OpenDir(TestDir()).status(),
                      {"model.safetensors.index.json", "neither"});
}

TEST(ShardedSafetensorsErrorTest, MissingShard) {
  ShardedFixture fixture{TestDir()};
  nlohmann::json weight_map = kGoodWeightMap;
  weight_map["c"] = "model-00003-of-00003.safetensors";
  WriteShardedCheckpoint(fixture, weight_map);
  ExpectErrorMentions(ShardedSafetensors::OpenDir(fixture.dir).status(),
                      {"model.safetensors.index.json", "shard 'model-00003-of-00003.safetensors'",
                       "tensor 'c'", "does not exist"});
}

TEST(ShardedSafetensorsErrorTest, IndexNamesTensorNotInShard) {
  ShardedFixture fixture{TestDir()};
  nlohmann::json weight_map = kGoodWeightMap;
  weight_map["ghost"] = "model-00002-of-00002.safetensors";
  WriteShardedCheckpoint(fixture, weight_map);
  ExpectErrorMentions(ShardedSafetensors::OpenDir(fixture.dir).status(),
                      {"model.safetensors.index.json", "tensor 'ghost'",
                       "shard 'model-00002-of-00002.safetensors'", "no such tensor"});
}

TEST(ShardedSafetensorsErrorTest, ShardHoldsUnlistedTensor) {
  ShardedFixture fixture{TestDir()};
  nlohmann::json weight_map = kGoodWeightMap;
  weight_map.erase("b");
  WriteShardedCheckpoint(fixture, weight_map);
  ExpectErrorMentions(ShardedSafetensors::OpenDir(fixture.dir).status(),
                      {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                       "tensor 'b'", "weight_map does not assign"});
}

TEST(ShardedSafetensorsErrorTest, CorruptShard) {
  ShardedFixture fixture{TestDir()};
  WriteShardedCheckpoint(fixture, kGoodWeightMap);
  WriteFile(fixture.dir + "/model-00002-of-00002.safetensors", "garbage");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(fixture.dir).status(),
                      {"model.safetensors.index.json", "model-00002-of-00002.safetensors",
                       "too short"});
}

TEST(ShardedSafetensorsErrorTest, BadIndex) {
  const std::string dir = TestDir();
  const std::string index = dir + "/model.safetensors.index.json";
  WriteFile(index, "{\"weight_map\": ");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(dir).status(),
                      {"model.safetensors.index.json", "not valid JSON"});
  WriteFile(index, R"({"metadata": {}})");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(dir).status(),
                      {"model.safetensors.index.json", "missing field 'weight_map'"});
  WriteFile(index, R"({"weight_map": {"a": 3}})");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(dir).status(),
                      {"model.safetensors.index.json", "tensor 'a'", "got integer"});
  WriteFile(index, R"({"weight_map": {"a": "../model.safetensors"}})");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(dir).status(),
                      {"model.safetensors.index.json", "tensor 'a'", "not a plain file name"});
  WriteFile(index, R"({"weight_map": {}})");
  ExpectErrorMentions(ShardedSafetensors::OpenDir(dir).status(),
                      {"model.safetensors.index.json", "'weight_map' is empty"});
}

}  // namespace
}  // namespace sg::io
