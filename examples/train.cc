// The main job: trains a model with a chosen strategy. With no flags it trains the embedded default, a small
// Llama-shaped model on the synthetic long-range retrieval task, in about two minutes on two cores.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/data.h"
#include "core/model_io.h"
#include "core/trainer.h"
#include "examples/common.h"

ABSL_FLAG(std::string, data, "", "token data: headerless .bin (see --data_dtype) or .jsonl; empty = synthetic task");
ABSL_FLAG(std::string, data_dtype, "uint16", "element type of a .bin token file: uint16 or uint32");
ABSL_FLAG(int64_t, seq_len, 4096, "tokens per sequence");
ABSL_FLAG(int64_t, steps, 300, "optimizer steps");
ABSL_FLAG(int64_t, batch, 1, "sequences per step");
ABSL_FLAG(double, lr, 3e-3, "AdamW learning rate");
ABSL_FLAG(double, weight_decay, 0.0, "AdamW decoupled weight decay");
ABSL_FLAG(std::string, report, "", "write a JSON report here");
ABSL_FLAG(std::string, save, "", "save the trained model (HF config.json + model.safetensors) to this directory");

namespace sg {
namespace {

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

int Main() {
  const int64_t seq_len = absl::GetFlag(FLAGS_seq_len);
  if (seq_len <= 0) tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len)), "flags");
  if (absl::GetFlag(FLAGS_steps) <= 0) tools::ExitIfError(absl::InvalidArgumentError("--steps must be positive"), "flags");
  if (absl::GetFlag(FLAGS_batch) <= 0) tools::ExitIfError(absl::InvalidArgumentError("--batch must be positive"), "flags");
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  const StrategyOptions strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(strategy), "flags");

  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<std::unique_ptr<TransformerModel>> model = LoadModel(tools::ModelSpec(), *dtype, seed);
  tools::ExitIfError(model.status(), "--model");
  const int64_t vocab = (*model)->vocab_size();

  // Data: a file, or the synthetic task generated on the fly.
  std::vector<Sequence> file_data;
  RetrievalTask task;
  const std::string data = absl::GetFlag(FLAGS_data);
  if (!data.empty()) {
    const std::string path = tools::ResolveUserPath(data);
    absl::StatusOr<std::vector<Sequence>> loaded;
    if (absl::EndsWith(path, ".jsonl")) {
      loaded = LoadJsonl(path, seq_len, vocab);
    } else {
      const std::string t = absl::GetFlag(FLAGS_data_dtype);
      if (t != "uint16" && t != "uint32")
        tools::ExitIfError(absl::InvalidArgumentError("--data_dtype must be uint16 or uint32"), "flags");
      loaded = LoadTokenBin(path, t == "uint16" ? 2 : 4, seq_len, vocab);
    }
    tools::ExitIfError(loaded.status(), "--data");
    file_data = std::move(*loaded);
  } else {
    task.seq_len = seq_len;
    task.vocab = vocab;
    tools::ExitIfError(task.Validate(), "synthetic task");
  }
  int64_t next_sequence = 0;
  auto next_batch = [&]() {
    std::vector<Sequence> batch;
    for (int64_t b = 0; b < absl::GetFlag(FLAGS_batch); ++b, ++next_sequence) {
      if (file_data.empty()) batch.push_back(task.Make(seed, next_sequence));
      else batch.push_back(file_data[next_sequence % file_data.size()]);
    }
    return batch;
  };

  OptimizerOptions opt;
  opt.lr = absl::GetFlag(FLAGS_lr);
  opt.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  Trainer trainer(**model, strategy, opt);
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const bool tty = isatty(fileno(stderr));
  std::fprintf(stderr, "seqgrad train: model=%s strategy=%s seq_len=%lld chunk=%lld steps=%lld data=%s\n",
               absl::GetFlag(FLAGS_model).c_str(), strategy.name.c_str(), static_cast<long long>(seq_len),
               static_cast<long long>(strategy.chunk), static_cast<long long>(steps),
               data.empty() ? "synthetic retrieval" : data.c_str());

  std::vector<double> losses;
  int64_t tokens = 0;
  double seconds = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<Sequence> batch = next_batch();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepMetrics> m = trainer.Step(batch);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tools::ExitIfError(m.status(), absl::StrCat("step ", step).c_str());
    for (const Sequence& s : batch) tokens += static_cast<int64_t>(s.ids.size());
    losses.push_back(m->loss);
    const MemorySnapshot mem = (*model)->memory().Snapshot();
    const std::string line = absl::StrFormat("step %lld/%lld  loss %.4f  %.0f tok/s  peak %s", step, steps, m->loss,
                                             tokens / seconds, Mib(mem.total_peak));
    if (tty) std::fprintf(stderr, "\r%s   ", line.c_str());
    else if (step == 1 || step == steps || step % std::max<int64_t>(1, steps / 10) == 0)
      std::fprintf(stderr, "%s\n", line.c_str());
  }
  if (tty) std::fprintf(stderr, "\n");

  const MemorySnapshot mem = (*model)->memory().Snapshot();
  std::printf("done: %lld steps, loss %.4f -> %.4f, %.0f tokens/s, peak %s\n", static_cast<long long>(steps),
              losses.front(), losses.back(), tokens / seconds, Mib(mem.total_peak).c_str());
  for (int i = 0; i < kNumMemCategories; ++i)
    std::printf("  peak %-12s %s\n", MemCategoryName(static_cast<MemCategory>(i)), Mib(mem.peak[i]).c_str());

  if (const std::string save = absl::GetFlag(FLAGS_save); !save.empty())
    tools::ExitIfError(SaveModel(**model, tools::ResolveUserPath(save)), "--save");
  if (const std::string report = absl::GetFlag(FLAGS_report); !report.empty()) {
    std::string losses_json;
    for (size_t i = 0; i < losses.size(); ++i) absl::StrAppend(&losses_json, i ? ", " : "", absl::StrFormat("%.6f", losses[i]));
    const std::string json = absl::StrFormat(
        "{\"model\": \"%s\", \"strategy\": \"%s\", \"seq_len\": %d, \"chunk\": %d, \"steps\": %d, "
        "\"loss_first\": %.6f, \"loss_last\": %.6f, \"tokens_per_s\": %.1f, \"peak_bytes\": %d, "
        "\"peak_bytes_by_category\": %s, \"losses\": [%s]}\n",
        absl::GetFlag(FLAGS_model), strategy.name, seq_len, strategy.chunk, steps, losses.front(), losses.back(),
        tokens / seconds, mem.total_peak, tools::PeakByCategoryJson(mem), losses_json);
    tools::ExitIfError(tools::WriteTextFile(tools::ResolveUserPath(report), json), "--report");
  }
  return 0;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Train a model on long sequences with a chosen gradient strategy.");
  absl::ParseCommandLine(argc, argv);
  return sg::Main();
}
