// Checkpoints: round trip and resume (bit-identical continuation, spaco's sampling included), corrupt and
// truncated files, mismatched run configs, keep-last-K, and a writer SIGKILLed at random moments of its saves.
#include "core/checkpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_format.h"
#include "core/model_io.h"
#include "core/test_batches.h"
#include "nlohmann/json.hpp"

namespace sg {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::unique_ptr<Model> Preset(const std::string& name, uint64_t seed = 3) {
  absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(name, DType::kF32, seed);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

StrategyOptions Spaco() {
  StrategyOptions o;
  o.name = "spaco";
  o.chunk = 4;
  o.page_size = 4;
  o.spaco_budget = 1;
  o.spaco_cap = 0;
  o.seed = 9;
  return o;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::vector<float> Values(Model& m) {
  std::vector<float> out;
  for (Param& p : m.params()) out.insert(out.end(), p.value.data<float>(), p.value.data<float>() + p.value.numel());
  return out;
}

// A trainer two steps in, and its checkpoint in dir.
struct Saved {
  std::unique_ptr<Model> model;
  std::unique_ptr<Trainer> trainer;
  std::string path;
  CheckpointMeta meta;
};
Saved TrainAndSave(const std::string& out_dir, const std::string& preset = "tiny") {
  Saved s;
  s.model = Preset(preset);
  OptimizerOptions oo;
  oo.lr = 1e-2;
  oo.lr_schedule = "cosine";
  oo.warmup_steps = 1;
  oo.total_steps = 10;
  s.trainer = std::make_unique<Trainer>(*s.model, Spaco(), oo);
  const std::vector<Sequence> batch = RaggedBatch(s.model->vocab_size(), 1);
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<StepMetrics> m = s.trainer->Step(batch);
    EXPECT_TRUE(m.ok()) << m.status();
    s.meta.history["loss"].push_back(m->loss);
  }
  s.meta.trainer = s.trainer->state();
  s.meta.seed = 9;
  s.meta.data_position = 2;
  s.meta.run_config = TrainerRunConfig(*s.trainer);
  s.meta.run_config["seq_len"] = "23";
  absl::StatusOr<std::string> path = SaveCheckpoint(out_dir, *s.trainer, s.meta, 2);
  EXPECT_TRUE(path.ok()) << path.status();
  s.path = path.ok() ? *path : "";
  return s;
}

TEST(Crc32Test, KnownValue) {
  EXPECT_EQ(Crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32("", 0), 0u);
  const std::string long_text(1000, 'x');
  EXPECT_EQ(Crc32(long_text.data() + 500, 500, Crc32(long_text.data(), 500)), Crc32(long_text.data(), 1000));
}

// A restored trainer continues exactly as the original: same weights, moments, schedule position and spaco draws.
TEST(CheckpointTest, ResumeContinuesBitIdentically) {
  const std::string dir = TempDir("resume");
  Saved s = TrainAndSave(dir);
  ASSERT_EQ(s.path, dir + "/checkpoint-2");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.json", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(s.path + "/" + f)) << f;
  // The checkpoint is also a Hugging Face model directory.
  absl::StatusOr<std::unique_ptr<Model>> hf = LoadAnyModel(s.path, DType::kF32, 0);
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(Values(**hf), Values(*s.model));

  auto model = Preset("tiny", /*seed=*/77);  // different initial weights: all of them come from the checkpoint
  Trainer resumed(*model, Spaco(), s.trainer->optimizer_options());
  const RunConfig expected = s.meta.run_config;
  absl::StatusOr<CheckpointMeta> meta = LoadCheckpoint(s.path, resumed, &expected);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->trainer.step, 2);
  EXPECT_EQ(meta->trainer.sampling_calls, s.trainer->state().sampling_calls);
  EXPECT_EQ(meta->data_position, 2);
  EXPECT_EQ(meta->seed, 9u);
  EXPECT_EQ(meta->history.at("loss"), s.meta.history.at("loss"));
  EXPECT_EQ(resumed.step(), 2);
  EXPECT_EQ(Values(*model), Values(*s.model));

  const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 1);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<StepMetrics> a = s.trainer->Step(batch), b = resumed.Step(batch);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->loss, b->loss) << i;  // exactly
    EXPECT_EQ(a->lr, b->lr);
    EXPECT_EQ(a->chunks_backpropagated, b->chunks_backpropagated);
  }
  EXPECT_EQ(Values(*model), Values(*s.model));
}

TEST(CheckpointTest, MambaRoundTrip) {
  const std::string dir = TempDir("mamba");
  Saved s = TrainAndSave(dir, "tiny-ssm");
  auto model = Preset("tiny-ssm", 5);
  Trainer resumed(*model, Spaco(), s.trainer->optimizer_options());
  ASSERT_TRUE(LoadCheckpoint(s.path, resumed).ok());
  EXPECT_EQ(Values(*model), Values(*s.model));
}

// Before the first optimizer step there are no moments; such a checkpoint loads too.
TEST(CheckpointTest, StepZero) {
  const std::string dir = TempDir("step0");
  auto model = Preset("tiny");
  Trainer trainer(*model, StrategyOptions{}, {});
  CheckpointMeta meta;
  meta.run_config = TrainerRunConfig(trainer);
  ASSERT_TRUE(SaveCheckpoint(dir, trainer, meta, 0).ok());
  auto other = Preset("tiny", 8);
  Trainer t2(*other, StrategyOptions{}, {});
  absl::StatusOr<CheckpointMeta> m = LoadCheckpoint(dir + "/checkpoint-0", t2);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->has_optimizer_state);
  EXPECT_EQ(Values(*other), Values(*model));
}

std::string ReadError(const std::string& dir) {
  absl::StatusOr<CheckpointMeta> m = ReadCheckpoint(dir);
  return m.ok() ? "(accepted)" : std::string(m.status().message());
}

// Each kind of damage is refused with the file and what is wrong; nothing crashes.
TEST(CheckpointTest, CorruptAndTruncatedFilesAreRefused) {
  const std::string dir = TempDir("corrupt");
  Saved s = TrainAndSave(dir);
  const std::string good = dir + "/good";
  fs::copy(s.path, good, fs::copy_options::recursive);
  auto fresh = [&](const std::string& name) {
    const std::string d = dir + "/" + name;
    fs::remove_all(d);
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  ASSERT_EQ(ReadError(good), "(accepted)");

  std::string d = fresh("truncated_model");
  fs::resize_file(d + "/model.safetensors", fs::file_size(d + "/model.safetensors") - 100);
  EXPECT_NE(ReadError(d).find(d + "/model.safetensors: truncated: "), std::string::npos) << ReadError(d);

  d = fresh("flipped_optimizer");
  std::string bytes = ReadFile(d + "/optimizer.safetensors");
  bytes[bytes.size() - 5] ^= 0x10;
  WriteFile(d + "/optimizer.safetensors", bytes);
  EXPECT_NE(ReadError(d).find(d + "/optimizer.safetensors: CRC-32 mismatch: the contents are corrupt"),
            std::string::npos)
      << ReadError(d);

  d = fresh("truncated_state");
  bytes = ReadFile(d + "/trainer_state.json");
  WriteFile(d + "/trainer_state.json", bytes.substr(0, bytes.size() / 2));
  EXPECT_NE(ReadError(d).find("trainer_state.json: not valid JSON"), std::string::npos) << ReadError(d);

  d = fresh("edited_state");  // valid JSON, a different step: the state's own CRC catches it
  bytes = ReadFile(d + "/trainer_state.json");
  const size_t at = bytes.find("\"step\": 2");
  ASSERT_NE(at, std::string::npos) << bytes;
  bytes.replace(at, 9, "\"step\": 3");
  WriteFile(d + "/trainer_state.json", bytes);
  EXPECT_NE(ReadError(d).find("trainer_state.json: CRC-32 mismatch"), std::string::npos) << ReadError(d);

  d = fresh("no_config");
  fs::remove(d + "/config.json");
  EXPECT_NE(ReadError(d).find(d + "/config.json: missing from the checkpoint"), std::string::npos) << ReadError(d);

  d = fresh("no_state");
  fs::remove(d + "/trainer_state.json");
  EXPECT_NE(ReadError(d).find("trainer_state.json: missing or unreadable: not a complete checkpoint"),
            std::string::npos)
      << ReadError(d);

  // A broken safetensors header whose size and CRC the (rewritten) state agrees with: the parser refuses it.
  d = fresh("bad_header");
  bytes = ReadFile(d + "/model.safetensors");
  bytes[8] = '[';
  WriteFile(d + "/model.safetensors", bytes);
  nlohmann::json state = nlohmann::json::parse(ReadFile(d + "/trainer_state.json"));
  state.erase("state_crc32");
  state["files"]["model.safetensors"]["crc32"] = absl::StrFormat("%08x", Crc32(bytes.data(), bytes.size()));
  const std::string body = state.dump();
  state["state_crc32"] = absl::StrFormat("%08x", Crc32(body.data(), body.size()));
  WriteFile(d + "/trainer_state.json", state.dump(1));
  EXPECT_NE(ReadError(d).find("model.safetensors"), std::string::npos) << ReadError(d);
  EXPECT_EQ(ReadError(d).find("CRC"), std::string::npos) << ReadError(d);

  // Random single-byte damage anywhere in any file: always refused, never a crash.
  std::mt19937_64 rng(1);
  for (int i = 0; i < 40; ++i) {
    d = fresh("random");
    const char* files[] = {"model.safetensors", "optimizer.safetensors", "config.json", "trainer_state.json"};
    const std::string f = d + "/" + files[rng() % 4];
    bytes = ReadFile(f);
    const size_t pos = rng() % bytes.size();
    bytes[pos] = static_cast<char>(bytes[pos] ^ (1 + rng() % 255));
    WriteFile(f, bytes);
    EXPECT_NE(ReadError(d), "(accepted)") << f << " byte " << pos;
  }

  // A checkpoint of another model: shapes named, nothing restored.
  auto other = Preset("tiny-qwen2");
  const std::vector<float> before = Values(*other);
  Trainer t(*other, StrategyOptions{}, {});
  absl::StatusOr<CheckpointMeta> m = LoadCheckpoint(good, t);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.safetensors: tensor '"), std::string::npos) << m.status();
  EXPECT_EQ(Values(*other), before);
}

TEST(CheckpointTest, DifferentRunConfigIsRefusedListingFields) {
  const std::string dir = TempDir("config");
  Saved s = TrainAndSave(dir);
  auto model = Preset("tiny", 77);
  const std::vector<float> before = Values(*model);
  StrategyOptions so = Spaco();
  so.chunk = 8;
  OptimizerOptions oo = s.trainer->optimizer_options();
  oo.lr = 3e-3;
  Trainer other(*model, so, oo);
  RunConfig expected = TrainerRunConfig(other);
  expected["seq_len"] = "64";
  absl::StatusOr<CheckpointMeta> m = LoadCheckpoint(s.path, other, &expected);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(m.status().message());
  EXPECT_NE(msg.find("different configuration (3 fields differ)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer.lr: checkpoint '0.01', now '0.003'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strategy.chunk: checkpoint '4', now '8'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("seq_len: checkpoint '23', now '64'"), std::string::npos) << msg;
  EXPECT_EQ(Values(*model), before);
  // Another model family and size: the model fields differ.
  auto ssm = Preset("tiny-ssm");
  Trainer ssm_trainer(*ssm, Spaco(), s.trainer->optimizer_options());
  RunConfig ssm_config = TrainerRunConfig(ssm_trainer);
  const std::vector<std::string> diff = DiffRunConfig(s.meta.run_config, ssm_config);
  EXPECT_NE(std::find_if(diff.begin(), diff.end(),
                         [](const std::string& l) {
                           return l.rfind("model.family: checkpoint 'transformer', now 'ssm'", 0) == 0;
                         }),
            diff.end());
}

TEST(CheckpointTest, KeepsNewestKAndFindsLatestComplete) {
  const std::string dir = TempDir("keep");
  auto model = Preset("tiny");
  Trainer trainer(*model, StrategyOptions{}, {});
  const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 1);
  CheckpointMeta meta;
  for (int step = 1; step <= 5; ++step) {
    ASSERT_TRUE(trainer.Step(batch).ok());
    meta.trainer = trainer.state();
    ASSERT_TRUE(SaveCheckpoint(dir, trainer, meta, 2).ok());
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-4", "checkpoint-5"}));
  // Saving an existing step replaces it.
  ASSERT_TRUE(SaveCheckpoint(dir, trainer, meta, 2).ok());
  EXPECT_EQ(ListCheckpoints(dir).size(), 2u);

  // Partial or foreign directories are never taken for checkpoints; a damaged newest one is skipped with a reason.
  fs::create_directories(dir + "/.tmp-checkpoint-9-1");
  fs::create_directories(dir + "/checkpoint-8");
  fs::create_directories(dir + "/checkpoint-x");
  fs::resize_file(dir + "/checkpoint-5/model.safetensors", 10);
  std::vector<std::string> skipped;
  absl::StatusOr<std::string> latest = FindLatestCheckpoint(dir, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, dir + "/checkpoint-4");
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[0].find("checkpoint-8/trainer_state.json: missing"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find("checkpoint-5/model.safetensors: truncated"), std::string::npos) << skipped[1];
  EXPECT_EQ(FindLatestCheckpoint(TempDir("empty")).status().code(), absl::StatusCode::kNotFound);
}

// The writer (a forked child: it uses the parent's model and runs no OpenMP): saves checkpoints of steps first,
// first + 1, ... forever, each with every weight set to its step.
[[noreturn]] void SaveForever(const std::string& dir, int64_t first, Model& model, Trainer& trainer) {
  for (int64_t step = first;; ++step) {
    for (Param& p : model.params()) std::fill_n(p.value.data<float>(), p.value.numel(), static_cast<float>(step));
    CheckpointMeta meta;
    meta.trainer.step = step;
    meta.trainer.sampling_calls = static_cast<uint64_t>(step);
    trainer.set_state(meta.trainer);
    meta.history["loss"].assign(static_cast<size_t>(step), 1.0);
    if (!SaveCheckpoint(dir, trainer, meta, 2).ok()) _exit(2);
  }
}

// fork + SIGKILL at random moments of a writer that saves continuously: every directory named checkpoint-<n>
// that exists afterwards is complete and loads with step n's weights, the newest never goes back, and leftovers
// of killed saves are never taken for checkpoints (and are cleaned up by the next writer).
TEST(CheckpointKillTest, KilledWriterLeavesLoadableCheckpoints) {
  const std::string dir = TempDir("kill");
  std::mt19937_64 rng(20240601);
  int64_t newest = 0;
  int saw_temporaries = 0;
  auto model = Preset("demo");
  Trainer reader(*model, StrategyOptions{}, {});
  auto writer_model = Preset("demo");
  Trainer writer(*writer_model, StrategyOptions{}, {});
  ASSERT_TRUE(writer.optimizer().EnsureMoments(*writer_model).ok());
  for (int iteration = 0; iteration < 30; ++iteration) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) SaveForever(dir, newest + 1, *writer_model, writer);
    std::this_thread::sleep_for(std::chrono::microseconds(1000 + rng() % 60000));
    ASSERT_EQ(kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "writer exited with " << WEXITSTATUS(status);

    for (const auto& e : fs::directory_iterator(dir)) saw_temporaries += e.path().filename().string()[0] == '.';
    const auto all = ListCheckpoints(dir);
    for (const auto& [step, path] : all) {
      absl::StatusOr<CheckpointMeta> m = LoadCheckpoint(path, reader);
      ASSERT_TRUE(m.ok()) << "iteration " << iteration << ": " << m.status();
      EXPECT_EQ(m->trainer.step, step);
      EXPECT_EQ(m->history.at("loss").size(), static_cast<size_t>(step));
      for (Param& p : model->params())
        ASSERT_EQ(p.value.data<float>()[p.value.numel() - 1], static_cast<float>(step)) << path << " " << p.name;
    }
    absl::StatusOr<std::string> latest = FindLatestCheckpoint(dir);
    if (newest > 0) {
      ASSERT_TRUE(latest.ok()) << "iteration " << iteration << ": the previous checkpoint is gone";
    }
    if (latest.ok()) {
      const int64_t step = all.front().first;
      EXPECT_EQ(*latest, all.front().second);
      EXPECT_GE(step, newest);
      newest = step;
    }
  }
  EXPECT_GT(newest, 0);
  std::printf("kill test: newest checkpoint %lld after 30 kills; %d leftover temporaries seen\n",
              static_cast<long long>(newest), saw_temporaries);
}

}  // namespace
}  // namespace sg
