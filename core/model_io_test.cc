// Bad input at the model and trainer boundary: clear errors naming the file, tensor or field.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "core/io/safetensors.h"
#include "core/model_io.h"
#include "core/presets.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::string TempDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/" + name;
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

TEST(ModelIoTest, SaveLoadRoundTrip) {
  auto model = LoadModel("tiny-qwen2", DType::kF64, 3);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string dir = TempDir("roundtrip");
  ASSERT_TRUE(SaveModel(**model, dir).ok());
  auto loaded = LoadModel(dir, DType::kF64, 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (size_t i = 0; i < (*model)->params().size(); ++i) {
    const Param& a = (*model)->params()[i];
    const Param& b = (*loaded)->params()[i];
    ASSERT_EQ(a.name, b.name);
    for (int64_t j = 0; j < a.value.numel(); ++j) ASSERT_EQ(a.value.data<double>()[j], b.value.data<double>()[j]);
  }
}

TEST(ModelIoTest, WrongShapeAndMissingTensorAreNamed) {
  auto model = LoadModel("tiny", DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  const std::string dir = TempDir("bad_shape");
  ASSERT_TRUE(SaveModel(**model, dir).ok());
  // Rewrite the weights with one tensor transposed and one missing.
  std::vector<io::TensorToWrite> tensors;
  std::vector<int64_t> transposed;
  for (Param& p : (*model)->params()) {
    if (p.name == "model.norm.weight") continue;
    io::TensorToWrite t{p.name, p.value.dtype(), p.value.shape(), p.value.raw()};
    if (p.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {p.value.dim(1), p.value.dim(0)};
    tensors.push_back(t);
  }
  ASSERT_TRUE(io::WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  absl::Status s = LoadModel(dir, DType::kF32, 0).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("k_proj"), std::string::npos) << s;

  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const io::TensorToWrite& t) { return t.name.find("k_proj") != std::string::npos; }),
                tensors.end());
  ASSERT_TRUE(io::WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  s = LoadModel(dir, DType::kF32, 0).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is missing"), std::string::npos) << s;
}

TEST(ModelIoTest, UnsupportedArchitectureIsNamed) {
  const std::string dir = TempDir("gpt2");
  std::system(("mkdir -p " + dir).c_str());
  std::ofstream(dir + "/config.json") << R"({"model_type": "gpt2", "vocab_size": 10})";
  absl::Status s = LoadModel(dir, DType::kF32, 0).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("gpt2"), std::string::npos) << s;
}

TEST(TrainerInputTest, BadBatchesAreRejected) {
  auto model = LoadModel("tiny", DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  Trainer trainer(**model, {}, {});
  Sequence out_of_vocab{{1, 2, 97}, {2, 3, 4}};
  absl::Status s = trainer.ComputeGradients({out_of_vocab}).status();
  EXPECT_NE(s.message().find("input id 97 at position 2"), std::string::npos) << s;
  EXPECT_NE(trainer.ComputeGradients({Sequence{}}).status().message().find("empty sequence"), std::string::npos);
  EXPECT_NE(trainer.ComputeGradients({Sequence{{1, 2}, {-100, -100}}}).status().message().find("no valid labels"),
            std::string::npos);
  StrategyOptions bad;
  bad.name = "seco";
  bad.chunk = 0;
  Trainer zero_chunk(**model, bad, {});
  EXPECT_NE(zero_chunk.ComputeGradients({Sequence{{1, 2}, {2, 3}}}).status().message().find("--chunk"),
            std::string::npos);
  bad.name = "magic";
  Trainer unknown(**model, bad, {});
  EXPECT_NE(unknown.ComputeGradients({Sequence{{1, 2}, {2, 3}}}).status().message().find("unknown strategy"),
            std::string::npos);
}

}  // namespace
}  // namespace sg
