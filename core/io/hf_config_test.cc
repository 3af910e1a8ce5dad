#include "core/models/transformer/config.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace sg::io {
namespace {

void ExpectErrorMentions(const absl::StatusOr<TransformerConfig>& result,
                         const std::vector<std::string>& parts) {
  ASSERT_FALSE(result.ok()) << "expected an error mentioning '" << parts.front() << "'";
  const std::string message(result.status().message());
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "error message lacks '" << part << "': " << message;
  }
}

absl::StatusOr<TransformerConfig> Parse(const std::string& json_text) {
  return ParseTransformerConfig(json_text, "config.json");
}

// Llama-3.2-1B's config.json, abridged to the fields that matter.
constexpr char kLlama32Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})";

// Qwen2-0.5B's config.json.
constexpr char kQwen2Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 131072,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// TinyLlama-style: no head_dim, no rope_scaling, untied, GQA.
constexpr char kTinyLlamaConfig[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "vocab_size": 32000
})";

// The smallest valid config; tests below add or break one field at a time.
std::string MinimalLlama(const std::string& extra_fields = "") {
  return R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128)" +
         extra_fields + "}";
}

TEST(HfConfigTest, Llama32WithRopeScalingAndTiedEmbeddings) {
  absl::StatusOr<TransformerConfig> config = Parse(kLlama32Config);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "llama");
  EXPECT_EQ(config->vocab_size, 128256);
  EXPECT_EQ(config->hidden_size, 2048);
  EXPECT_EQ(config->num_layers, 16);
  EXPECT_EQ(config->num_heads, 32);
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->intermediate_size, 8192);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(config->rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(config->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(config->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->attention_bias);
  EXPECT_EQ(config->max_position_embeddings, 131072);
}

TEST(HfConfigTest, LlamaDefaults) {
  absl::StatusOr<TransformerConfig> config = Parse(kTinyLlamaConfig);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 64);  // hidden_size / num_attention_heads
  EXPECT_EQ(config->num_kv_heads, 4);
  EXPECT_EQ(config->rope_scaling.type, "default");
  EXPECT_FALSE(config->tie_word_embeddings);

  absl::StatusOr<TransformerConfig> minimal = Parse(MinimalLlama());
  ASSERT_TRUE(minimal.ok()) << minimal.status();
  EXPECT_EQ(minimal->num_kv_heads, 4);
  EXPECT_EQ(minimal->head_dim, 16);
  EXPECT_DOUBLE_EQ(minimal->rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(minimal->rms_norm_eps, 1e-6);
  EXPECT_EQ(minimal->max_position_embeddings, 2048);
  EXPECT_FALSE(minimal->tie_word_embeddings);
  EXPECT_FALSE(minimal->attention_bias);

  absl::StatusOr<TransformerConfig> with_bias = Parse(MinimalLlama(R"(, "attention_bias": true)"));
  ASSERT_TRUE(with_bias.ok()) << with_bias.status();
  EXPECT_TRUE(with_bias->attention_bias);
}

TEST(HfConfigTest, Qwen2) {
  absl::StatusOr<TransformerConfig> config = Parse(kQwen2Config);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "qwen2");
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->hidden_size, 896);
  EXPECT_EQ(config->num_heads, 14);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->intermediate_size, 4864);
  EXPECT_DOUBLE_EQ(config->rope_theta, 1e6);
  EXPECT_TRUE(config->attention_bias);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_EQ(config->rope_scaling.type, "default");
}

TEST(HfConfigTest, ArchitecturesWhenModelTypeMissing) {
  absl::StatusOr<TransformerConfig> config = Parse(
      R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, "qwen2");
  EXPECT_TRUE(config->attention_bias);
  EXPECT_EQ(config->max_position_embeddings, 32768);
}

TEST(HfConfigTest, RopeScalingOldTypeKeyAndDefault) {
  absl::StatusOr<TransformerConfig> config = Parse(MinimalLlama(
      R"(, "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1,
                            "high_freq_factor": 4, "original_max_position_embeddings": 8192})"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(config->rope_scaling.factor, 8.0);

  absl::StatusOr<TransformerConfig> plain =
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "default"})"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->rope_scaling.type, "default");
}

// transformers >= 5 writes "rope_parameters", with rope_theta inside.
TEST(HfConfigTest, RopeParametersOfTransformers5) {
  absl::StatusOr<TransformerConfig> config = Parse(MinimalLlama(
      R"(, "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192,
                               "rope_theta": 500000.0, "rope_type": "llama3"})"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->rope_scaling.type, "llama3");
  EXPECT_EQ(config->rope_scaling.original_max_position_embeddings, 8192);

  absl::StatusOr<TransformerConfig> plain = Parse(MinimalLlama(
      R"(, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
          "layer_types": ["full_attention", "full_attention"])"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_DOUBLE_EQ(plain->rope_theta, 1e6);
  EXPECT_EQ(plain->rope_scaling.type, "default");

  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_parameters": {"rope_theta": 1e6, "rope_type": "longrope"})")),
      {"config.json: field 'rope_parameters.rope_type' is 'longrope', which is not supported"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_parameters": {"rope_theta": "big", "rope_type": "default"})")),
      {"config.json: field 'rope_parameters.rope_theta' must be a number, got string"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "layer_types": ["full_attention", "sliding_attention"])")),
      {"config.json: field 'layer_types' has 'sliding_attention'; only 'full_attention' is "
       "supported"});
}

// transformers' defaults for each scaling type; original_max_position_embeddings defaults to
// max_position_embeddings (2048 for a Llama config without it).
TEST(HfConfigTest, RopeScalingTypes) {
  absl::StatusOr<TransformerConfig> linear = Parse(MinimalLlama(R"(, "rope_scaling": {"type": "linear", "factor": 2})"));
  ASSERT_TRUE(linear.ok()) << linear.status();
  EXPECT_EQ(linear->rope_scaling.type, "linear");
  EXPECT_EQ(linear->rope_scaling.factor, 2.0);
  absl::StatusOr<TransformerConfig> dynamic =
      Parse(MinimalLlama(R"(, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})"));
  ASSERT_TRUE(dynamic.ok()) << dynamic.status();
  EXPECT_EQ(dynamic->rope_scaling.type, "dynamic");
  EXPECT_EQ(dynamic->rope_scaling.factor, 4.0);

  // Qwen2.5's 128K recipe.
  absl::StatusOr<TransformerConfig> yarn = Parse(MinimalLlama(
      R"(, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})"));
  ASSERT_TRUE(yarn.ok()) << yarn.status();
  const RopeScaling& y = yarn->rope_scaling;
  EXPECT_EQ(y.type, "yarn");
  EXPECT_EQ(y.factor, 4.0);
  EXPECT_EQ(y.original_max_position_embeddings, 32768);
  EXPECT_EQ(y.beta_fast, 32.0);
  EXPECT_EQ(y.beta_slow, 1.0);
  EXPECT_EQ(y.attention_factor, 0.0);
  EXPECT_TRUE(y.truncate);
  absl::StatusOr<TransformerConfig> yarn_full = Parse(MinimalLlama(
      R"(, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": null, "beta_fast": 8,
          "beta_slow": 2,
          "attention_factor": 1.5, "mscale": 1, "mscale_all_dim": 0.5, "truncate": false})"));
  ASSERT_TRUE(yarn_full.ok()) << yarn_full.status();
  const RopeScaling& f = yarn_full->rope_scaling;
  EXPECT_EQ(f.original_max_position_embeddings, 4096);
  EXPECT_EQ(f.factor, 1.0);  // max_position_embeddings / original_max_position_embeddings
  EXPECT_EQ(f.beta_fast, 8.0);
  EXPECT_EQ(f.beta_slow, 2.0);
  EXPECT_EQ(f.attention_factor, 1.5);
  EXPECT_EQ(f.mscale, 1.0);
  EXPECT_EQ(f.mscale_all_dim, 0.5);
  EXPECT_FALSE(f.truncate);
  // A top-level original_max_position_embeddings wins over the block's.
  absl::StatusOr<TransformerConfig> top = Parse(MinimalLlama(
      R"(, "original_max_position_embeddings": 1024,
          "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                           "original_max_position_embeddings": 8192})"));
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->rope_scaling.original_max_position_embeddings, 1024);
}

// Qwen3: q_norm / k_norm, head_dim 128 unless given, optional attention_bias; Llama's mlp_bias.
TEST(HfConfigTest, Qwen3AndLlamaBiases) {
  absl::StatusOr<TransformerConfig> qwen3 = Parse(
      R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96})");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(qwen3->architecture, "qwen3");
  EXPECT_EQ(qwen3->head_dim, 128);
  EXPECT_TRUE(qwen3->qk_norm());
  EXPECT_FALSE(qwen3->attention_bias);
  EXPECT_EQ(qwen3->max_position_embeddings, 32768);
  absl::StatusOr<TransformerConfig> by_name = Parse(
      R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "head_dim": 32, "intermediate_size": 96, "attention_bias": true})");
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ(by_name->architecture, "qwen3");
  EXPECT_EQ(by_name->head_dim, 32);
  EXPECT_TRUE(by_name->o_bias());
  absl::StatusOr<TransformerConfig> llama = Parse(MinimalLlama(R"(, "mlp_bias": true, "attention_bias": true)"));
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_TRUE(llama->mlp_bias);
  EXPECT_TRUE(llama->o_bias());
  EXPECT_FALSE(llama->qk_norm());
}

TEST(HfConfigTest, WrittenJsonParsesBackUnchanged) {
  const std::string yarn_qwen3 =
      R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "head_dim": 32, "intermediate_size": 96, "attention_bias": true,
          "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512,
                           "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25, "truncate": false}})";
  const std::string dynamic_llama = MinimalLlama(R"(, "mlp_bias": true, "attention_bias": true,
                                                    "rope_scaling": {"rope_type": "dynamic", "factor": 3})");
  const std::string linear_llama = MinimalLlama(R"(, "rope_scaling": {"rope_type": "linear", "factor": 2.5})");
  for (const std::string& text : {std::string(kLlama32Config), std::string(kQwen2Config),
                                  std::string(kTinyLlamaConfig), yarn_qwen3, dynamic_llama, linear_llama}) {
    absl::StatusOr<TransformerConfig> original = Parse(text);
    ASSERT_TRUE(original.ok()) << original.status();
    const std::string written = TransformerConfigToHFJson(*original);
    absl::StatusOr<TransformerConfig> reread = Parse(written);
    ASSERT_TRUE(reread.ok()) << reread.status() << "\n" << written;
    EXPECT_EQ(reread->architecture, original->architecture);
    EXPECT_EQ(reread->vocab_size, original->vocab_size);
    EXPECT_EQ(reread->hidden_size, original->hidden_size);
    EXPECT_EQ(reread->num_layers, original->num_layers);
    EXPECT_EQ(reread->num_heads, original->num_heads);
    EXPECT_EQ(reread->num_kv_heads, original->num_kv_heads);
    EXPECT_EQ(reread->head_dim, original->head_dim);
    EXPECT_EQ(reread->intermediate_size, original->intermediate_size);
    EXPECT_EQ(reread->rms_norm_eps, original->rms_norm_eps);
    EXPECT_EQ(reread->rope_theta, original->rope_theta);
    EXPECT_EQ(reread->rope_scaling.type, original->rope_scaling.type);
    EXPECT_EQ(reread->rope_scaling.factor, original->rope_scaling.factor);
    EXPECT_EQ(reread->rope_scaling.low_freq_factor, original->rope_scaling.low_freq_factor);
    EXPECT_EQ(reread->rope_scaling.high_freq_factor, original->rope_scaling.high_freq_factor);
    EXPECT_EQ(reread->rope_scaling.original_max_position_embeddings,
              original->rope_scaling.original_max_position_embeddings);
    EXPECT_EQ(reread->tie_word_embeddings, original->tie_word_embeddings);
    EXPECT_EQ(reread->attention_bias, original->attention_bias);
    EXPECT_EQ(reread->mlp_bias, original->mlp_bias);
    EXPECT_EQ(reread->rope_scaling.attention_factor, original->rope_scaling.attention_factor);
    EXPECT_EQ(reread->rope_scaling.beta_fast, original->rope_scaling.beta_fast);
    EXPECT_EQ(reread->rope_scaling.beta_slow, original->rope_scaling.beta_slow);
    EXPECT_EQ(reread->rope_scaling.truncate, original->rope_scaling.truncate);
    EXPECT_EQ(reread->max_position_embeddings, original->max_position_embeddings);
    EXPECT_NE(written.find("\"torch_dtype\": \"float32\""), std::string::npos);
  }
}

TEST(HfConfigTest, LoadFromDirectoryOrFile) {
  const std::string dir = ::testing::TempDir() + "/hf_config_load";
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/config.json") << kQwen2Config;
  absl::StatusOr<TransformerConfig> from_dir = LoadTransformerConfig(dir);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->architecture, "qwen2");
  absl::StatusOr<TransformerConfig> from_file = LoadTransformerConfig(dir + "/config.json");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->vocab_size, 151936);

  ExpectErrorMentions(LoadTransformerConfig(dir + "/absent.json"), {"absent.json", "cannot open"});
  std::ofstream(dir + "/broken.json") << R"({"model_type": "gpt2"})";
  ExpectErrorMentions(LoadTransformerConfig(dir + "/broken.json"),
                      {"broken.json: model_type 'gpt2' is not supported"});
}

// ---- Bad inputs.

TEST(HfConfigErrorTest, UnsupportedArchitecture) {
  ExpectErrorMentions(Parse(R"({"model_type": "gpt2", "vocab_size": 50257})"),
                      {"config.json: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, qwen3_moe, mixtral, "
                       "qwen3_next, qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, mamba2, bamba, nemotron_h, "
                       "falcon_h1)"});
  ExpectErrorMentions(Parse(R"({"architectures": ["MistralForCausalLM"]})"),
                      {"config.json", "MistralForCausalLM", "not supported"});
  ExpectErrorMentions(Parse(R"({"vocab_size": 10})"),
                      {"config.json", "field 'model_type' is missing"});
  ExpectErrorMentions(Parse(R"({"model_type": 7})"),
                      {"config.json", "field 'model_type' must be a string, got integer"});
  ExpectErrorMentions(Parse(R"({"architectures": "LlamaForCausalLM"})"),
                      {"config.json", "field 'architectures' must be an array"});
}

TEST(HfConfigErrorTest, MissingRequiredFields) {
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "intermediate_size"}) {
    std::string text = MinimalLlama();
    const size_t at = text.find(std::string("\"") + field + "\"");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 1, "\"x_");  // renames the field
    ExpectErrorMentions(Parse(text),
                        {"config.json: field '" + std::string(field) + "' is missing"});
  }
}

TEST(HfConfigErrorTest, WrongTypes) {
  ExpectErrorMentions(
      Parse(R"({"model_type": "llama", "vocab_size": "100"})"),
      {"config.json: field 'vocab_size' must be an integer, got string"});
  ExpectErrorMentions(
      Parse(R"({"model_type": "llama", "vocab_size": 100.5})"),
      {"config.json: field 'vocab_size' must be an integer, got number"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rms_norm_eps": "1e-5")")),
                      {"config.json: field 'rms_norm_eps' must be a number, got string"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "tie_word_embeddings": "yes")")),
                      {"config.json: field 'tie_word_embeddings' must be a boolean, got string"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": 8)")),
                      {"config.json: field 'rope_scaling' must be an object or null, got integer"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "hidden_act": 1)")),
                      {"config.json: field 'hidden_act' must be a string"});
}

TEST(HfConfigErrorTest, BadSizes) {
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "num_key_value_heads": 0)")),
                      {"config.json: field 'num_key_value_heads' must be positive, got 0"});
  ExpectErrorMentions(Parse(R"({"model_type": "llama", "vocab_size": -5})"),
                      {"config.json: field 'vocab_size' must be positive, got -5"});
  ExpectErrorMentions(Parse(R"({"model_type": "llama", "vocab_size": 18446744073709551615})"),
                      {"config.json: field 'vocab_size' is too large"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "num_key_value_heads": 3)")),
                      {"config.json: field 'num_key_value_heads' (3) must divide "
                       "num_attention_heads (4)"});
  ExpectErrorMentions(
      Parse(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 66,
                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128})"),
      {"config.json: field 'hidden_size' (66) must be divisible by num_attention_heads (4)"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_theta": 0)")),
                      {"config.json: field 'rope_theta' must be a positive finite number, got 0"});
}

// RoPE blocks that transformers 5.23 refuses, only warns about while computing something else than the config says,
// or of which it silently ignores one key: each refused, naming the field.
TEST(HfConfigErrorTest, RopeBlocksTransformersWarnsAboutOrIgnores) {
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32})")),
      {"config.json: field 'rope_scaling.beta_fast' (1) is less than beta_slow (32)"});
  // transformers: KeyError for an absent yarn factor; null is max_position_embeddings / original (here 0.5).
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096})")),
      {"config.json: field 'rope_scaling.factor' is missing"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "yarn", "factor": null,
                                                               "original_max_position_embeddings": 4096})")),
                      {"config.json: field 'rope_scaling.factor' is 0.5 (null: max_position_embeddings / "
                       "original_max_position_embeddings); it must be >= 1"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "linear", "factor": 0.5})")),
                      {"config.json: field 'rope_scaling.factor' is 0.5; it must be >= 1"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2})")),
      {"config.json: field 'rope_scaling.type' is 'linear' but rope_type is 'dynamic'"});
  absl::StatusOr<TransformerConfig> same_type =
      Parse(MinimalLlama(R"(, "rope_scaling": {"type": "dynamic", "rope_type": "dynamic", "factor": 2})"));
  ASSERT_TRUE(same_type.ok()) << same_type.status();
  EXPECT_EQ(same_type->rope_scaling.type, "dynamic");
  // transformers would take rope_scaling and drop rope_parameters (with its rope_theta); the same block twice is fine.
  const std::string qwen3 = R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "head_dim": 16,
      "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rope_scaling": )";
  ExpectErrorMentions(Parse(qwen3 + R"({"rope_type": "linear", "factor": 4}})"),
                      {"config.json: field 'rope_scaling' and field 'rope_parameters' are both given and differ"});
  absl::StatusOr<TransformerConfig> same_block = Parse(qwen3 + R"({"rope_type": "default", "rope_theta": 1e6}})");
  ASSERT_TRUE(same_block.ok()) << same_block.status();
  EXPECT_EQ(same_block->rope_theta, 1e6);
  // Read as transformers reads them: the old "type", and the top-level rope_theta where a block has none.
  absl::StatusOr<TransformerConfig> same_reading =
      Parse(MinimalLlama(R"(, "rope_theta": 5e5, "rope_parameters": {"rope_type": "linear", "factor": 2},
                            "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 500000})"));
  ASSERT_TRUE(same_reading.ok()) << same_reading.status();
  EXPECT_EQ(same_reading->rope_theta, 5e5);
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_theta": 5e5, "rope_parameters": {"rope_type": "linear",
                            "factor": 2}, "rope_scaling": {"type": "linear", "factor": 2, "rope_theta": 1e4})")),
                      {"config.json: field 'rope_scaling' and field 'rope_parameters' are both given and differ"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 1e300})")),
                      {"config.json: field 'rope_scaling.factor' is 1e+300: dynamic RoPE's base overflows"});
  absl::StatusOr<TransformerConfig> large = Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "dynamic",
                                                                                        "factor": 1e6})"));
  ASSERT_TRUE(large.ok()) << large.status();
}

// Dynamic NTK's base is rope_theta up to max_position_embeddings, also for a factor where transformers' form
// factor T / M - (factor - 1) loses it to rounding; past M it follows theta (1 + factor (T - M) / M)^(d / (d - 2)).
TEST(HfConfigTest, DynamicRopeBase) {
  absl::StatusOr<TransformerConfig> c =
      Parse(MinimalLlama(R"(, "max_position_embeddings": 128, "rope_scaling": {"rope_type": "dynamic", "factor": 1e17})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(DynamicRopeBase(*c, 1), 1e4);
  EXPECT_EQ(DynamicRopeBase(*c, 128), 1e4);
  c->rope_scaling.factor = 2;
  EXPECT_NEAR(DynamicRopeBase(*c, 192), 1e4 * std::pow(2.0, 16.0 / 14.0), 1e-9);
}

TEST(HfConfigErrorTest, UnsupportedOptions) {
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "ntk-by-parts", "factor": 4})")),
      {"config.json: field 'rope_scaling.rope_type' is 'ntk-by-parts', which is not supported (supported: "
       "default, linear, dynamic, yarn, llama3)"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": {"type": "su", "factor": 4})")),
                      {"config.json: field 'rope_scaling.type' is 'su', which is not supported"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "linear"})")),
                      {"config.json: field 'rope_scaling.factor' is missing"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": "fast"})")),
      {"config.json: field 'rope_scaling.beta_fast' must be a number, got string"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 2, "partial_rotary_factor": 0.5})")),
      {"config.json: field 'rope_scaling.partial_rotary_factor' is 0.5; llama rotates whole heads (1)"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"factor": 8})")),
      {"config.json: field 'rope_scaling.rope_type' is missing"});
  ExpectErrorMentions(
      Parse(MinimalLlama(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
                             "low_freq_factor": 4, "high_freq_factor": 4,
                             "original_max_position_embeddings": 8192})")),
      {"config.json: field 'rope_scaling.high_freq_factor' must be greater"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "hidden_act": "gelu")")),
                      {"config.json: field 'hidden_act' is 'gelu'; only 'silu' is supported"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "use_sliding_window": true)")),
                      {"config.json: field 'use_sliding_window' is true, which is not supported"});
  ExpectErrorMentions(Parse(MinimalLlama(R"(, "mlp_bias": 1)")),
                      {"config.json: field 'mlp_bias' must be a boolean, got integer"});
}

TEST(HfConfigErrorTest, NotJson) {
  ExpectErrorMentions(Parse("{\"model_type\": \"llama\",}"), {"config.json: not valid JSON"});
  ExpectErrorMentions(Parse(""), {"config.json: not valid JSON"});
  ExpectErrorMentions(Parse("[1, 2]"), {"config.json: must be a JSON object, got array"});
  ExpectErrorMentions(Parse(R"({"model_type": "llama", "model_type": "qwen2"})"),
                      {"config.json: duplicate JSON key 'model_type'"});
}

// A Qwen3.5 text config with transformers' defaults but for the sizes; extra fields appended.
// Which layers are Gated DeltaNet.
std::vector<bool> Linear(const TransformerConfig& c) {
  std::vector<bool> linear;
  for (int64_t l = 0; l < c.num_layers; ++l) linear.push_back(c.is_linear(l));
  return linear;
}

std::string MinimalQwen35(const std::string& model_type = "qwen3_5_text", const std::string& extra_fields = "") {
  return R"({"model_type": ")" + model_type + R"(", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128)" +
         extra_fields + "}";
}

TEST(HfConfigTest, HybridDefaultsAndLayerTypes) {
  absl::StatusOr<TransformerConfig> c = Parse(MinimalQwen35());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->hybrid());
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->rotary_dim(), 64);  // partial_rotary_factor 0.25
  EXPECT_EQ(Linear(*c), (std::vector<bool>{true, true, true, false, true, true, true, false}));
  EXPECT_EQ(c->linear.key_heads, 16);
  EXPECT_EQ(c->linear.value_heads, 32);
  EXPECT_EQ(c->linear.key_head_dim, 128);
  EXPECT_EQ(c->linear.conv_kernel, 4);
  c = Parse(MinimalQwen35("qwen3_next", R"(, "num_experts": 0, "full_attention_interval": 2,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.5})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Linear(*c), (std::vector<bool>{true, false, true, false, true, false, true, false}));
  EXPECT_EQ(c->rotary_dim(), 128);
  EXPECT_EQ(c->rope_theta, 1e6);
  // The published layout: the text model under text_config, its head tied at the top level.
  c = Parse(R"({"model_type": "qwen3_5", "tie_word_embeddings": true, "vision_config": {"depth": 1},
                "text_config": )" + MinimalQwen35() + "}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->conditional);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->prefix(), "model.language_model.");
  // What the engine writes reads back the same.
  absl::StatusOr<TransformerConfig> again = Parse(TransformerConfigToHFJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->mixers, c->mixers);
  EXPECT_TRUE(again->conditional);
  EXPECT_EQ(again->rotary_dim(), c->rotary_dim());
}

TEST(HfConfigTest, MixturesOfExperts) {
  // Qwen3-Next's defaults: 512 experts in every layer, 10 a token, renormalised, a shared expert.
  absl::StatusOr<TransformerConfig> c = Parse(MinimalQwen35("qwen3_next"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->moe_layers, std::vector<bool>(8, true));
  EXPECT_EQ(c->moe.experts, 512);
  EXPECT_EQ(c->moe.top_k, 10);
  EXPECT_TRUE(c->moe.normalize);
  EXPECT_EQ(c->moe.shared_intermediate, 512);
  // Qwen3-MoE: dense layers by mlp_only_layers and decoder_sparse_step; no renormalisation by default.
  c = Parse(R"({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->moe_layers, (std::vector<bool>{false, true, false, false}));
  EXPECT_FALSE(c->moe.normalize);
  EXPECT_EQ(c->moe.shared_intermediate, 0);
  EXPECT_TRUE(c->qk_norm());
  absl::StatusOr<TransformerConfig> again = Parse(TransformerConfigToHFJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->moe_layers, c->moe_layers);
  EXPECT_EQ(again->moe.intermediate, 32);
  // Mixtral: every layer, intermediate_size is the experts', 1e-5 and 1e6 defaults.
  c = Parse(R"({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 48, "num_local_experts": 4})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->moe_layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(c->moe.intermediate, 48);
  EXPECT_EQ(c->moe.top_k, 2);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_theta, 1e6);
  ExpectErrorMentions(Parse(R"({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
                                "router_jitter_noise": 0.1})"),
                      {"field 'router_jitter_noise' is 0.1; random router noise in training is not supported"});
  ExpectErrorMentions(Parse(R"({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
                                "sliding_window": 4096})"),
                      {"field 'sliding_window' is set"});
}

TEST(HfConfigErrorTest, HybridErrorsNameTheField) {
  ExpectErrorMentions(Parse(MinimalQwen35("qwen3_5_text", R"(, "layer_types": ["linear_attention"])")),
                      {"field 'layer_types' lists 1 layers; num_hidden_layers is 8"});
  ExpectErrorMentions(Parse(MinimalQwen35("qwen3_5_text", R"(, "layer_types": ["linear_attention", "mamba",
                                           "full_attention", "full_attention", "full_attention", "full_attention",
                                           "full_attention", "full_attention"])")),
                      {"field 'layer_types' has 'mamba'"});
  ExpectErrorMentions(Parse(MinimalQwen35("qwen3_5_text", R"(, "linear_num_value_heads": 24)")),
                      {"field 'linear_num_value_heads' (24) must be a multiple of linear_num_key_heads (16)"});
  ExpectErrorMentions(Parse(MinimalQwen35("qwen3_next", R"(, "num_experts": 4, "num_experts_per_tok": 5)")),
                      {"field 'num_experts_per_tok' (5) exceeds num_experts (4)"});
  ExpectErrorMentions(Parse(MinimalQwen35("qwen3_5_text", R"(, "partial_rotary_factor": 0.001)")),
                      {"field 'partial_rotary_factor' is 0.001"});
  ExpectErrorMentions(
      Parse(MinimalQwen35("qwen3_5_text", R"(, "rope_parameters": {"rope_type": "linear", "factor": 2})")),
      {"field 'rope_parameters' has rope_type 'linear'"});
  ExpectErrorMentions(Parse(R"({"model_type": "qwen3_5", "text_config": {"model_type": "llama"}})"),
                      {"field 'text_config.model_type' is 'llama'"});
  ExpectErrorMentions(Parse(R"({"model_type": "qwen3_5"})"), {"field 'text_config' is missing"});
  // A flag per layer: a billion layers are refused before the lists are made (not after seconds of work).
  for (const char* type : {"qwen3_5_text", "qwen3_moe"})
    ExpectErrorMentions(Parse(absl::StrCat(R"({"model_type": ")", type, R"(", "vocab_size": 100, "hidden_size": 64,
                                           "num_hidden_layers": 1000000000, "num_attention_heads": 4,
                                           "intermediate_size": 128})")),
                        {"field 'num_hidden_layers' is 1000000000;", "supported up to 65536 layers"});
}

// Mamba-2 models and hybrids: transformers 5.23's fields (and defaults) in, the same config back out.
TEST(HfConfigTest, Mamba2FamilyRoundTrips) {
  absl::StatusOr<TransformerConfig> m = Parse(R"({"model_type": "mamba2", "vocab_size": 50, "hidden_size": 16,
      "num_hidden_layers": 2, "num_heads": 4, "head_dim": 8, "state_size": 6, "n_groups": 2, "chunk_size": 16,
      "use_bias": true, "time_step_limit": [0.0, {"__float__": "Infinity"}], "tie_word_embeddings": true})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->mixers, std::vector<Mixer>(2, Mixer::kMamba2));
  EXPECT_EQ(m->mlps, std::vector<Mlp>(2, Mlp::kNone));
  EXPECT_EQ(m->mamba.conv_dim(), 32 + 2 * 2 * 6);
  EXPECT_TRUE(std::isinf(m->mamba.dt_max));
  EXPECT_TRUE(m->mamba.proj_bias && m->mamba.conv_bias && m->tie_word_embeddings);

  absl::StatusOr<TransformerConfig> b = Parse(R"({"model_type": "bamba", "vocab_size": 50, "hidden_size": 16,
      "num_hidden_layers": 3, "attn_layer_indices": [1], "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 24, "mamba_n_heads": 4, "mamba_d_head": "auto", "mamba_d_state": 6,
      "time_step_limit": [0.05, 1.5], "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}})");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->mixers, (std::vector<Mixer>{Mixer::kMamba2, Mixer::kAttention, Mixer::kMamba2}));
  EXPECT_EQ(b->mamba.head_dim, 8);  // 2 x 16 / 4
  EXPECT_EQ(b->rotary_dim(), 2);    // Bamba rotates half of each head
  EXPECT_EQ(b->rope_theta, 5000.0);
  EXPECT_EQ(b->mamba.dt_min, 0.05);

  absl::StatusOr<TransformerConfig> n = Parse(R"({"model_type": "nemotron_h", "vocab_size": 50, "hidden_size": 16,
      "hybrid_override_pattern": "M-*-", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
      "intermediate_size": 24, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 6, "n_groups": 2})");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->num_layers, 4);
  EXPECT_EQ(n->mixers, (std::vector<Mixer>{Mixer::kMamba2, Mixer::kNone, Mixer::kAttention, Mixer::kNone}));
  EXPECT_EQ(n->mlps, (std::vector<Mlp>{Mlp::kNone, Mlp::kRelu2, Mlp::kNone, Mlp::kRelu2}));
  EXPECT_FALSE(n->rope);
  EXPECT_EQ(n->mamba.dt_min, 0.001);  // time_step_min: NemotronHMamba2Mixer's clamp

  // Falcon-H1 as published: a mixer mamba_d_ssm wide (not mamba_expand x hidden_size), the muP multipliers.
  absl::StatusOr<TransformerConfig> f = Parse(R"({"architectures": ["FalconH1ForCausalLM"], "vocab_size": 50,
      "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "intermediate_size": 24, "mamba_d_ssm": 24, "mamba_n_heads": 4, "mamba_d_head": 6, "mamba_d_state": 5,
      "mamba_n_groups": 2, "mamba_rms_norm": true, "mamba_norm_before_gate": false, "mamba_use_mlp": true,
      "embedding_multiplier": 5.5, "lm_head_multiplier": 0.04, "attention_in_multiplier": 1.5,
      "key_multiplier": 0.4, "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24,
      "ssm_multipliers": [0.35, 0.25, 0.5, 0.75, 0.3], "mlp_multipliers": [0.9, 0.6], "pad_token_id": 0,
      "rope_theta": 1e11, "attn_layer_indices": null})");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->architecture, "falcon_h1");
  EXPECT_EQ(f->mixers, std::vector<Mixer>(2, Mixer::kAttentionMamba2));
  EXPECT_EQ(f->mlp(1), Mlp::kSwiGlu);
  EXPECT_EQ(f->mamba.intermediate(), 24);
  EXPECT_EQ(f->mamba.conv_dim(), 24 + 2 * 2 * 5);
  EXPECT_TRUE(f->mamba.gated_norm);
  EXPECT_EQ(f->mup.ssm, (std::vector<double>{0.35, 0.25, 0.5, 0.75, 0.3}));
  EXPECT_EQ(std::vector<double>({f->mup.embedding, f->mup.lm_head, f->mup.key, f->mup.mlp_gate, f->mup.mlp_down}),
            std::vector<double>({5.5, 0.04, 0.4, 0.9, 0.6}));
  EXPECT_EQ(f->rope_theta, 1e11);
  EXPECT_EQ(f->pad_token_id, 0);
  // FalconH1Config's defaults: a 1024-wide mixer, head_dim "auto" = 1024 / heads, no gated norm, multipliers of 1.
  absl::StatusOr<TransformerConfig> d = Parse(R"({"model_type": "falcon_h1", "vocab_size": 50, "hidden_size": 16,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->mamba.head_dim, 128);
  EXPECT_EQ(d->head_dim, 4);
  EXPECT_FALSE(d->mamba.gated_norm);
  EXPECT_TRUE(d->mup == MupMultipliers());
  // The footprint counts both mixers of every layer, and the gated norm only where mamba_rms_norm asks for it.
  absl::StatusOr<ModelFootprint> with_norm = Footprint(*f, DType::kF32);
  TransformerConfig without = *f;
  without.mamba.gated_norm = false;
  absl::StatusOr<ModelFootprint> without_norm = Footprint(without, DType::kF32);
  ASSERT_TRUE(with_norm.ok() && without_norm.ok());
  const int64_t attention = 2 * 32 * 16 + 2 * 16 * 16;                  // q, o; k, v
  const int64_t mamba = 72 * 16 + 44 * 4 + 44 + 16 * 24 + 3 * 4 + 24;  // in_proj, conv and bias, out_proj, heads, norm
  const int64_t embed_head_norms = 2 * 50 * 16 + 5 * 16, rope = 4;
  EXPECT_EQ(with_norm->parameters, embed_head_norms + rope + 2 * (attention + mamba + 3 * 24 * 16));
  EXPECT_EQ(with_norm->parameters - without_norm->parameters, 2 * 24);

  for (const TransformerConfig* c : {&*m, &*b, &*n, &*f, &*d}) {
    absl::StatusOr<TransformerConfig> again = Parse(TransformerConfigToHFJson(*c));
    ASSERT_TRUE(again.ok()) << c->architecture << ": " << again.status();
    EXPECT_EQ(again->architecture, c->architecture);
    EXPECT_EQ(again->mixers, c->mixers);
    EXPECT_EQ(again->mlps, c->mlps);
    EXPECT_EQ(again->num_layers, c->num_layers);
    EXPECT_EQ(again->head_dim, c->head_dim);
    EXPECT_EQ(again->rotary_dim(), c->rotary_dim());
    EXPECT_EQ(again->rope_theta, c->rope_theta);
    const Mamba2Config &x = again->mamba, &y = c->mamba;
    EXPECT_EQ(std::vector<int64_t>({x.heads, x.head_dim, x.groups, x.state, x.conv_kernel, x.chunk_size}),
              std::vector<int64_t>({y.heads, y.head_dim, y.groups, y.state, y.conv_kernel, y.chunk_size}));
    EXPECT_EQ(std::vector<double>({x.dt_min, x.dt_max, x.norm_eps}),
              std::vector<double>({y.dt_min, y.dt_max, y.norm_eps}));
    EXPECT_EQ(x.proj_bias, y.proj_bias);
    EXPECT_EQ(x.conv_bias, y.conv_bias);
    EXPECT_EQ(x.gated_norm, y.gated_norm);
    EXPECT_TRUE(again->mup == c->mup) << c->architecture;
    EXPECT_EQ(again->pad_token_id, c->pad_token_id);
  }
}

// What the engine does not implement is refused by the field that asks for it, before any work.
TEST(HfConfigTest, Mamba2FamilyRefusalsNameTheField) {
  const std::string mamba2 = R"({"model_type": "mamba2", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2,
      "num_heads": 4)";
  ExpectErrorMentions(Parse(mamba2 + R"(, "head_dim": 8, "n_groups": 2, "hidden_act": "gelu"})"),
                      {"field 'hidden_act' is 'gelu'"});
  ExpectErrorMentions(Parse(mamba2 + R"(, "head_dim": 4, "n_groups": 2})"), {"field 'num_heads' (4) x head_dim (4)"});
  ExpectErrorMentions(Parse(mamba2 + R"(, "head_dim": 8, "n_groups": 3})"), {"field 'n_groups' (3) must divide"});
  ExpectErrorMentions(Parse(mamba2 + R"(, "head_dim": 8, "n_groups": 2, "time_step_limit": [1.0, 0.5]})"),
                      {"field 'time_step_limit'"});
  // A billion layers are refused before the per-layer lists are made.
  ExpectErrorMentions(Parse(R"({"model_type": "mamba2", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers":
                               1000000000, "num_heads": 4, "head_dim": 8, "n_groups": 2})"),
                      {"field 'num_hidden_layers' is 1000000000;", "supported up to 65536 layers"});
  ExpectErrorMentions(Parse(R"({"model_type": "bamba", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers":
                               1000000000, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4})"),
                      {"field 'num_hidden_layers' is 1000000000;", "supported up to 65536 layers"});
  const std::string bamba = R"({"model_type": "bamba", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24, "mamba_n_heads": 4)";
  ExpectErrorMentions(Parse(bamba + R"(, "z_loss_coefficient": 0.1})"), {"field 'z_loss_coefficient' is 0.1"});
  ExpectErrorMentions(Parse(bamba + R"(, "attn_layer_indices": [2]})"), {"field 'attn_layer_indices' holds 2"});
  ExpectErrorMentions(Parse(bamba + R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})"),
                      {"field 'rope_parameters' has rope_type 'linear'"});
  const std::string falcon = R"({"model_type": "falcon_h1", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers":
      2, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4)";
  ExpectErrorMentions(Parse(falcon + R"(, "mamba_d_ssm": 24, "mamba_d_head": 8})"),
                      {"field 'mamba_n_heads' (4) x head_dim (8) must equal mamba_d_ssm (24)"});
  ExpectErrorMentions(Parse(falcon + R"(, "mamba_rms_norm": true})"), {"field 'mamba_norm_before_gate' is true"});
  ExpectErrorMentions(Parse(falcon + R"(, "projectors_bias": true})"), {"field 'projectors_bias' is true"});
  ExpectErrorMentions(Parse(falcon + R"(, "attention_bias": true})"), {"field 'attention_bias' is true"});
  ExpectErrorMentions(Parse(falcon + R"(, "mamba_proj_bias": true})"), {"field 'mamba_proj_bias' is true"});
  ExpectErrorMentions(Parse(falcon + R"(, "mamba_use_mlp": false})"), {"field 'mamba_use_mlp' is false"});
  ExpectErrorMentions(Parse(falcon + R"(, "ssm_multipliers": [1, 1, 1, 1]})"),
                      {"field 'ssm_multipliers' must be a list of 5 numbers"});
  ExpectErrorMentions(Parse(falcon + R"(, "mlp_multipliers": [1, -1]})"), {"field 'mlp_multipliers' holds -1"});
  ExpectErrorMentions(Parse(falcon + R"(, "key_multiplier": 0})"), {"field 'key_multiplier'"});
  ExpectErrorMentions(Parse(falcon + R"(, "hidden_act": "gelu"})"), {"field 'hidden_act' is 'gelu'"});
  ExpectErrorMentions(Parse(falcon + R"(, "pad_token_id": 50})"), {"field 'pad_token_id' is 50"});
  const std::string nemotron = R"({"model_type": "nemotron_h", "vocab_size": 50, "hidden_size": 16,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24, "mamba_num_heads": 4,
      "mamba_head_dim": 8, "n_groups": 2)";
  ExpectErrorMentions(Parse(nemotron + R"(, "hybrid_override_pattern": "M-E*"})"),
                      {"field 'hybrid_override_pattern' has 'moe'", "mixture-of-experts"});
  ExpectErrorMentions(Parse(nemotron + R"(, "layers_block_type": ["mlp", "conv"]})"),
                      {"field 'layers_block_type' has 'conv'"});
  const std::string layers = R"(, "hybrid_override_pattern": "M-*")";
  ExpectErrorMentions(Parse(nemotron + layers + R"(, "mlp_hidden_act": "silu"})"),
                      {"field 'mlp_hidden_act' is 'silu'"});
  ExpectErrorMentions(Parse(nemotron + layers + R"(, "num_nextn_predict_layers": 1})"),
                      {"field 'num_nextn_predict_layers' is 1"});
  ExpectErrorMentions(Parse(nemotron + layers + R"(, "sliding_window": 128})"), {"field 'sliding_window' is set"});
  ExpectErrorMentions(Parse(nemotron + layers + R"(, "tie_word_embeddings": true})"),
                      {"field 'tie_word_embeddings' is true"});
}

}  // namespace
}  // namespace sg::io
