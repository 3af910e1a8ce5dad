// Bad inputs through the C ABI (libseqgrad.so): every entry answers with a status that names the argument or file,
// in bounded time and memory; out of memory is RESOURCE_EXHAUSTED with the bytes asked and available.
#include <string>

#include "gtest/gtest.h"
#include "seqgrad/seqgrad.h"
#include "tests/bad_input_support.h"

namespace {

using ::sg::testing::Bounded;
using ::sg::testing::MakeFifo;
using ::sg::testing::ReleaseFifo;
using ::sg::testing::TmpDir;
using ::sg::testing::WriteFile;

constexpr int64_t kMiB = 1 << 20;

// The status's code and message; frees it.
struct Result {
  int code = SG_OK;
  std::string message;
};
Result Take(sg_status* s) {
  Result r;
  if (s) {
    r.code = sg_status_code(s);
    r.message = sg_status_message(s);
    sg_status_free(s);
  }
  return r;
}

Result LoadConfig(const std::string& name, const std::string& config) {
  const std::string dir = TmpDir("c_" + name);
  WriteFile(dir + "/config.json", config);
  sg_model* model = nullptr;
  Result r = Take(sg_model_load(dir.c_str(), "f32", &model));
  EXPECT_EQ(model, nullptr);
  EXPECT_NE(r.message.find(dir + "/config.json"), std::string::npos) << r.message;
  return r;
}

TEST(BadInputC, OversizedConfigsAreRefused) {
  Bounded("sg_model_load of oversized configs", 20, 64 * kMiB, [] {
    Result r = LoadConfig("mamba_hidden", R"({"model_type": "mamba", "vocab_size": 97, "hidden_size": 4611686018427387904,
                                              "expand": 1, "num_hidden_layers": 2})");
    EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
    r = LoadConfig("mamba_state", R"({"model_type": "mamba", "vocab_size": 97, "hidden_size": 16,
                                      "state_size": 4611686018427387904, "num_hidden_layers": 2})");
    EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("sg_model_load: "), std::string::npos) << r.message;
    r = LoadConfig("vocab_2e40_hidden_2e30", R"({"model_type": "llama", "vocab_size": 1099511627776,
        "hidden_size": 1073741824, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64})");
    EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("vocab_size"), std::string::npos) << r.message;
    r = LoadConfig("vocab_1e9", R"({"model_type": "llama", "vocab_size": 1000000000, "hidden_size": 4096,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64})");
    EXPECT_EQ(r.code, SG_ERR_RESOURCE_EXHAUSTED) << r.message;
    EXPECT_NE(r.message.find("bytes are available"), std::string::npos) << r.message;
    r = LoadConfig("layers_1e9", R"({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "num_hidden_layers": 1000000000, "num_attention_heads": 4, "intermediate_size": 64})");
    EXPECT_EQ(r.code, SG_ERR_RESOURCE_EXHAUSTED) << r.message;
  });
}

TEST(BadInputC, FifoConfigIsRefusedWithoutBlocking) {
  const std::string dir = TmpDir("c_fifo");
  const std::string fifo = MakeFifo(dir + "/config.json");
  Bounded("sg_model_load with a FIFO config.json", 10, 64 * kMiB, [&] {
    sg_model* model = nullptr;
    Result r = Take(sg_model_load(dir.c_str(), "f32", &model));
    EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find(fifo + ": is a FIFO"), std::string::npos) << r.message;
  }, [&] { ReleaseFifo(fifo); });
}

TEST(BadInputC, LoraRankAboveTheWeightsIsRefused) {
  sg_model* model = nullptr;
  ASSERT_EQ(Take(sg_model_create_preset("tiny", "f32", 0, &model)).code, SG_OK);
  sg_lora_options o = sg_lora_default_options();
  o.rank = 100000;
  Bounded("sg_model_enable_lora rank 100000", 10, 64 * kMiB, [&] {
    Result r = Take(sg_model_enable_lora(model, &o));
    EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("exceeds min(in, out)"), std::string::npos) << r.message;
  });
  o.rank = 1000000000;
  EXPECT_EQ(Take(sg_model_enable_lora(model, &o)).code, SG_ERR_INVALID_ARGUMENT);
  o.rank = 4;  // still usable afterwards
  EXPECT_EQ(Take(sg_model_enable_lora(model, &o)).code, SG_OK);
  sg_model_free(model);
}

// Negative and out-of-vocabulary ids and labels given to a step are refused naming them.
TEST(BadInputC, StepIdsAndLabels) {
  sg_model* model = nullptr;
  ASSERT_EQ(Take(sg_model_create_preset("tiny", "f32", 0, &model)).code, SG_OK);
  sg_trainer_options options = sg_trainer_default_options();
  sg_trainer* trainer = nullptr;
  ASSERT_EQ(Take(sg_trainer_create(model, &options, &trainer)).code, SG_OK);
  const int32_t ids[4] = {1, -5, 2, 3}, labels[4] = {1, 2, 3, 4};
  const int32_t good_ids[4] = {1, 2, 3, 4}, bad_labels[4] = {1, -101, 3, 4};
  sg_metrics m = sg_metrics_init();
  const int64_t lengths[1] = {4};
  Result r = Take(sg_trainer_step(trainer, ids, labels, 4, lengths, 1, &m));
  EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
  EXPECT_EQ(r.message.find("label"), std::string::npos) << "an input id reported as a label: " << r.message;
  r = Take(sg_trainer_step(trainer, good_ids, bad_labels, 4, lengths, 1, &m));
  EXPECT_EQ(r.code, SG_ERR_INVALID_ARGUMENT) << r.message;
  EXPECT_NE(r.message.find("label"), std::string::npos) << r.message;
  sg_trainer_free(trainer);
  sg_model_free(model);
}

}  // namespace
