// Bad input at the model and trainer boundary: clear errors naming the file, tensor or field.
#include "core/model_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/io/safetensors.h"
#include "core/models/transformer/transformer.h"
#include "core/trainer.h"
#include "nlohmann/json.hpp"

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

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
std::string Spit(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}
std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}
// Staging directories left beside `dir` by a save.
int Leftovers(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(dir).parent_path()))
    n += e.path().filename().string().find(".seqgrad-save-") != std::string::npos;
  return n;
}

// A save of a model loaded from a Hugging Face directory is a complete model directory: the tokenizer, chat template,
// generation config and the config.json fields the engine does not use come along, the dtype is labelled as saved,
// and the directory holds exactly one model, or stays as it was when the save fails.
// The footprint a model is checked against before it is made counts every parameter it makes (and RoPE's
// frequencies): the Mamba-2 mixers' tensors, the ReLU² MLPs, layers without an MLP or a mixer.
TEST(ModelIoTest, FootprintCountsEveryParameter) {
  for (const char* preset :
       {"tiny", "tiny-qwen3.5", "tiny-mamba2", "tiny-bamba", "tiny-nemotron-h", "tiny-falcon-h1"}) {
    auto model = LoadModel(preset, DType::kF32, 1);
    ASSERT_TRUE(model.ok()) << preset << ": " << model.status();
    absl::StatusOr<ModelFootprint> f = Footprint((*model)->config(), DType::kF32);
    ASSERT_TRUE(f.ok()) << preset << ": " << f.status();
    const TransformerConfig& c = (*model)->config();
    int64_t parameters = c.attention_layer_count() > 0 && c.rope ? c.rotary_dim() / 2 : 0;
    for (const Param& p : (*model)->params()) parameters += p.value.numel();
    EXPECT_EQ(f->parameters, parameters) << preset;
  }
}

// Falcon-H1-7B's shape: every layer holds attention and a Mamba-2 mixer besides its MLP (7.59 B parameters).
TEST(ModelIoTest, FalconH1ShapeFootprint) {
  absl::StatusOr<TransformerConfig> c = TransformerPreset("falcon-h1-7b-shape");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<ModelFootprint> f = Footprint(*c, DType::kBF16);
  ASSERT_TRUE(f.ok()) << f.status();
  const int64_t d = 3072, attention = 2 * 1536 * d + 2 * 256 * d, mlp = 3 * 12288 * d;
  const int64_t mamba = (3072 + 3584 + 24) * d + 3584 * 4 + 3584 + d * 3072 + 3 * 24 + 3072;  // in, conv, out, norm
  EXPECT_EQ(f->parameters, 2 * 130048 * d + 44 * (attention + mlp + mamba + 2 * d) + d + 64);
}

TEST(ModelIoTest, SaveIsCompleteAndAllOrNothing) {
  auto preset = LoadModel("tiny-qwen2", DType::kF64, 3);
  ASSERT_TRUE(preset.ok());
  const std::string src = TempDir("complete_src");
  ASSERT_TRUE(SaveModel(**preset, src).ok());
  nlohmann::json config = nlohmann::json::parse(Slurp(src + "/config.json"));
  config["bos_token_id"] = 5;
  config["eos_token_id"] = std::vector<int>{6, 7};
  config["pad_token_id"] = 0;
  config["use_cache"] = true;
  Spit(src + "/config.json", config.dump());
  const std::map<std::string, std::string> carried = {
      {"tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}"},
      {"tokenizer_config.json", "{\"chat_template\": \"{% for m in messages %}{{ m.content }}{% endfor %}\"}"},
      {"special_tokens_map.json", "{\"eos_token\": \"</s>\"}"},
      {"chat_template.jinja", "{{ messages }}"},
      {"generation_config.json", "{\"eos_token_id\": [6, 7], \"do_sample\": false}"}};
  for (const auto& [name, text] : carried) Spit(src + "/" + name, text);

  auto model = LoadModel(src, DType::kF64, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  // Saving over a sharded model: its index and shards must go.
  const std::string dst = TempDir("complete_dst");
  mkdir(dst.c_str(), 0755);
  for (const char* stale : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            "model.safetensors.index.json", "config.json"})
    Spit(dst + "/" + stale, "stale");
  absl::Status s = SaveModel(**model, dst, src);
  ASSERT_TRUE(s.ok()) << s;
  std::set<std::string> expected = {"config.json", "model.safetensors"};
  for (const auto& [name, text] : carried) {
    expected.insert(name);
    EXPECT_EQ(Slurp(dst + "/" + name), text) << name;
  }
  EXPECT_EQ(Files(dst), expected);
  EXPECT_EQ(Leftovers(dst), 0);
  const nlohmann::json saved = nlohmann::json::parse(Slurp(dst + "/config.json"));
  EXPECT_EQ(saved["torch_dtype"], "float64");
  EXPECT_EQ(saved["dtype"], "float64");
  EXPECT_EQ(saved["bos_token_id"], 5);
  EXPECT_EQ(saved["eos_token_id"], nlohmann::json({6, 7}));
  EXPECT_EQ(saved["pad_token_id"], 0);
  EXPECT_EQ(saved["use_cache"], true);
  auto reloaded = LoadModel(dst, DType::kF32, 0);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  const std::string f32 = TempDir("complete_f32");
  ASSERT_TRUE(SaveModel(**reloaded, f32, dst).ok());
  EXPECT_EQ(nlohmann::json::parse(Slurp(f32 + "/config.json"))["dtype"], "float32");

  // A tokenizer file that cannot be read (a broken link, as in a damaged Hugging Face cache): the save fails naming
  // it, the existing directory keeps its model and files, and nothing is left behind.
  const std::string broken = TempDir("complete_broken");
  std::filesystem::copy(src, broken);
  std::remove((broken + "/tokenizer.json").c_str());
  ASSERT_EQ(symlink("/nonexistent/blob", (broken + "/tokenizer.json").c_str()), 0);
  const std::string before = Slurp(dst + "/model.safetensors");
  s = SaveModel(**reloaded, dst, broken);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tokenizer.json"), std::string::npos) << s;
  EXPECT_EQ(Files(dst), expected);
  EXPECT_TRUE(Slurp(dst + "/model.safetensors") == before) << "a failed save changed the weights";
  EXPECT_EQ(Leftovers(dst), 0);
  const std::string fresh = TempDir("complete_fresh");
  EXPECT_FALSE(SaveModel(**reloaded, fresh, broken).ok());
  EXPECT_FALSE(std::filesystem::exists(fresh));
  EXPECT_EQ(Leftovers(fresh), 0);

  // Beside other entries (train's checkpoints, notes) the model's files are replaced and the rest stays; a source
  // without a tokenizer takes the earlier one's files away.
  Spit(dst + "/notes.txt", "mine");
  mkdir((dst + "/checkpoint-2").c_str(), 0755);
  s = SaveModel(**reloaded, dst);  // f32 now, and no source
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Files(dst), (std::set<std::string>{"checkpoint-2", "config.json", "model.safetensors", "notes.txt"}));
  EXPECT_EQ(Slurp(dst + "/notes.txt"), "mine");
  EXPECT_TRUE(Slurp(dst + "/model.safetensors") != before) << "the weights were not replaced";
  EXPECT_EQ(nlohmann::json::parse(Slurp(dst + "/config.json"))["dtype"], "float32");
  EXPECT_EQ(Leftovers(dst), 0);
  // There an earlier sharded model cannot go at once with the rest: refused, naming its file, nothing changed.
  Spit(dst + "/model.safetensors.index.json", "{}");
  const std::string current = Slurp(dst + "/model.safetensors");
  s = SaveModel(**reloaded, dst, src);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(dst + "/model.safetensors.index.json: an earlier model's file"), std::string::npos) << s;
  EXPECT_TRUE(Slurp(dst + "/model.safetensors") == current) << "a refused save changed the weights";
}

// What a save carries over from the source directory: regular files inside it (or in a Hugging Face hub cache's
// blobs), JSON that parses. Anything else is refused naming the file, before anything is written, and a link out of
// the directory never brings its target's content into the saved model.
TEST(ModelIoTest, SaveCarriesOnlyFilesOfTheSourceDirectory) {
  auto model = LoadModel("tiny", DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  const std::string root = TempDir("carry");
  const std::string hub = root + "/models--org--tiny";
  const std::string src = hub + "/snapshots/abc123";
  std::filesystem::create_directories(hub + "/blobs");
  std::filesystem::create_directories(hub + "/snapshots");
  ASSERT_TRUE(SaveModel(**model, src).ok());
  Spit(hub + "/blobs/0f1e", "{\"model\": {\"type\": \"BPE\"}}");
  ASSERT_EQ(symlink("../../blobs/0f1e", (src + "/tokenizer.json").c_str()), 0);  // the hub cache's layout
  const std::string dst = root + "/saved";
  absl::Status s = SaveModel(**model, dst, src);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Slurp(dst + "/tokenizer.json"), "{\"model\": {\"type\": \"BPE\"}}");

  Spit(root + "/secret", "{\"password\": \"hunter2\"}");
  mkfifo((root + "/fifo").c_str(), 0644);
  std::filesystem::create_directory(root + "/a_directory");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {root + "/secret", "it links to " + root + "/secret, outside the model directory"},
      {"/dev/zero", "it links to /dev/zero, outside the model directory"},
      {"nowhere", "a link that leads nowhere"},
      {"generation_config.json", "a link that leads nowhere (Too many levels of symbolic links)"},  // itself
      {"../../blobs/missing", "a link that leads nowhere"},
  };
  for (const auto& [target, says] : bad) {
    const std::string link = src + "/generation_config.json";
    std::remove(link.c_str());
    ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
    for (absl::Status refused : {CheckModelSave(root + "/fresh", src), SaveModel(**model, root + "/fresh", src)}) {
      EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << target << ": " << refused;
      EXPECT_NE(refused.message().find("cannot carry over " + link + ": " + says), std::string::npos)
          << target << ": " << refused;
    }
    EXPECT_FALSE(std::filesystem::exists(root + "/fresh")) << target;
    EXPECT_EQ(Leftovers(root + "/fresh"), 0) << target;
  }
  std::remove((src + "/generation_config.json").c_str());
  const std::vector<std::pair<std::string, std::string>> bad_files = {
      {"{\"eos_token_id\": [6, 7]", "generation_config.json: not valid JSON"},
      {"", "generation_config.json: not valid JSON"},
  };
  for (const auto& [text, says] : bad_files) {
    Spit(src + "/generation_config.json", text);
    absl::Status refused = CheckModelSave(root + "/fresh", src);
    EXPECT_NE(refused.message().find(says), std::string::npos) << refused;
  }
  std::remove((src + "/generation_config.json").c_str());
  std::filesystem::rename(root + "/a_directory", src + "/generation_config.json");
  EXPECT_NE(CheckModelSave(root + "/fresh", src).message().find("generation_config.json: is a directory"),
            std::string::npos);
  std::filesystem::remove(src + "/generation_config.json");
  std::filesystem::rename(root + "/fifo", src + "/generation_config.json");
  EXPECT_NE(CheckModelSave(root + "/fresh", src).message().find("generation_config.json: is a FIFO"),
            std::string::npos);
  std::filesystem::remove(src + "/generation_config.json");
  std::filesystem::resize_file(Spit(src + "/vocab.txt", ""), (int64_t{1} << 30) + 1);  // sparse: costs nothing
  EXPECT_NE(CheckModelSave(root + "/fresh", src).message().find("more than the limit of 1073741824 bytes"),
            std::string::npos);
  std::filesystem::remove(src + "/vocab.txt");
  EXPECT_TRUE(CheckModelSave(root + "/fresh", src).ok());
}

// CheckModelSave refuses, without writing anything, the targets a save would refuse after training.
TEST(ModelIoTest, CheckModelSaveRefusesBadTargets) {
  const std::string root = TempDir("targets");
  std::filesystem::create_directories(root);
  Spit(root + "/file", "x");
  ASSERT_EQ(symlink(root.c_str(), (root + "/link").c_str()), 0);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"/dev/null", "/dev/null: exists and is not a directory"},
      {root + "/file", root + "/file: exists and is not a directory"},
      {root + "/link", root + "/link: exists and is not a directory"},
      {root + "/missing/model", root + "/missing: cannot save there: No such file or directory"},
      {root + "/file/model", root + "/file/model: cannot save there: Not a directory"},
  };
  for (const auto& [target, says] : bad) {
    absl::Status s = CheckModelSave(target);
    EXPECT_NE(s.message().find(says), std::string::npos) << target << ": " << s;
  }
  EXPECT_TRUE(CheckModelSave(root + "/model").ok());
  EXPECT_TRUE(CheckModelSave(root + "/model/").ok());
  EXPECT_TRUE(CheckWritableTarget(root + "/adapter").ok());
  EXPECT_NE(CheckWritableTarget("/dev/null").message().find("exists and is not a directory"), std::string::npos);
  EXPECT_EQ(Files(root), (std::set<std::string>{"file", "link"}));
}

// Staging directories of saves killed with kill -9 (unlocked) are removed by the next save or check beside them; a
// live save's (locked) stays.
TEST(ModelIoTest, StaleStagingDirectoriesAreRemoved) {
  auto model = LoadModel("tiny", DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  const std::string root = TempDir("stale");
  std::filesystem::create_directories(root);
  for (const char* name : {"model.seqgrad-save-a1b2c3", "other.seqgrad-save-d4e5f6", "live.seqgrad-save-g7h8i9"}) {
    std::filesystem::create_directory(root + "/" + name);
    Spit(root + "/" + name + "/model.safetensors", std::string(1 << 20, 'w'));
  }
  const int live = open((root + "/live.seqgrad-save-g7h8i9").c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(live, 0);
  ASSERT_EQ(flock(live, LOCK_EX), 0);
  Spit(root + "/notes.seqgrad-save-kept", "not a staging directory");
  ASSERT_TRUE(SaveModel(**model, root + "/model").ok());
  EXPECT_EQ(Files(root), (std::set<std::string>{"live.seqgrad-save-g7h8i9", "model", "notes.seqgrad-save-kept"}));
  close(live);  // its save is killed now
  ASSERT_TRUE(CheckModelSave(root + "/another").ok());
  EXPECT_EQ(Files(root), (std::set<std::string>{"model", "notes.seqgrad-save-kept"}));
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
