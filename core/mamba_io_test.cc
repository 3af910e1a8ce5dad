// Mamba checkpoints in HF format: save/load round trip through LoadAnyModel, and clear errors for configs and
// tensors the engine does not implement.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "core/io/safetensors.h"
#include "core/model_io.h"
#include "core/models/mamba/config.h"

namespace sg {
namespace {

std::string TempDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/" + name;
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

void WriteConfig(const std::string& dir, const std::string& text) { std::ofstream(dir + "/config.json") << text; }

TEST(MambaIoTest, SaveLoadRoundTrip) {
  auto model = LoadAnyModel("tiny-ssm", DType::kF64, 3);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->family(), "ssm");
  const std::string dir = TempDir("mamba_roundtrip");
  ASSERT_TRUE(SaveModel(**model, dir).ok());
  auto loaded = LoadAnyModel(dir, DType::kF64, 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->family(), "ssm");
  ASSERT_EQ((*model)->params().size(), (*loaded)->params().size());
  for (size_t i = 0; i < (*model)->params().size(); ++i) {
    const Param& a = (*model)->params()[i];
    const Param& b = (*loaded)->params()[i];
    ASSERT_EQ(a.name, b.name);
    for (int64_t j = 0; j < a.value.numel(); ++j) ASSERT_EQ(a.value.data<double>()[j], b.value.data<double>()[j]);
  }
  // Transformers still load through the same entry point.
  auto llama = LoadAnyModel("tiny", DType::kF32, 1);
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ((*llama)->family(), "transformer");
}

TEST(MambaIoTest, ConfigFieldsAndErrors) {
  absl::StatusOr<MambaConfig> c = io::ParseMambaConfig(
      R"({"model_type": "mamba", "vocab_size": 50, "hidden_size": 40, "num_hidden_layers": 2, "state_size": 8,
          "expand": 2, "conv_kernel": 3, "time_step_rank": "auto", "use_bias": true, "residual_in_fp32": true,
          "use_mambapy": false})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->time_step_rank, 3);  // ceil(40 / 16)
  EXPECT_EQ(c->intermediate_size, 80);
  EXPECT_TRUE(c->use_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  absl::StatusOr<MambaConfig> back = io::ParseMambaConfig(io::MambaConfigToHFJson(*c), "saved");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->time_step_rank, 3);
  EXPECT_EQ(back->conv_kernel, 3);

  const std::string dir = TempDir("mamba3");
  std::system(("mkdir -p " + dir).c_str());
  WriteConfig(dir, R"({"model_type": "mamba3", "vocab_size": 50, "hidden_size": 40, "num_hidden_layers": 2})");
  absl::Status s = LoadAnyModel(dir, DType::kF32, 0).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model_type 'mamba3'"), std::string::npos) << s;

  absl::Status act = io::ParseMambaConfig(R"({"model_type": "mamba", "vocab_size": 5, "hidden_size": 4,
      "num_hidden_layers": 1, "hidden_act": "gelu"})",
                                          "config.json")
                         .status();
  EXPECT_NE(act.message().find("hidden_act"), std::string::npos) << act;
}

// A checkpoint whose dt_rank or state size differs from its config: the mismatching tensor is named.
class MambaWrongShapeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MambaWrongShapeTest, WrongShapeIsNamed) {
  const std::string bad = GetParam();
  auto model = LoadAnyModel("tiny-ssm", DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  const std::string dir = TempDir("mamba_bad_shape");
  ASSERT_TRUE(SaveModel(**model, dir).ok());
  std::vector<io::TensorToWrite> tensors;
  std::vector<float> wide(64 * 3, 0.f);
  for (Param& p : (*model)->params()) {
    io::TensorToWrite t{p.name, p.value.dtype(), p.value.shape(), p.value.raw()};
    if (p.name == bad) {
      t.shape = {p.value.dim(0), 3};
      t.data = wide.data();
    }
    tensors.push_back(t);
  }
  ASSERT_TRUE(io::WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  absl::Status s = LoadAnyModel(dir, DType::kF32, 0).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(bad), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Tensors, MambaWrongShapeTest,
                         ::testing::Values("backbone.layers.1.mixer.dt_proj.weight", "backbone.layers.0.mixer.A_log"));

}  // namespace
}  // namespace sg
