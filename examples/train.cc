// The main job: trains a model with a chosen strategy. With no flags it trains the embedded default, a small
// Llama-shaped model on the synthetic long-range retrieval task, in about two minutes on two cores.
// --objective=dpo|grpo trains on preference pairs / scored completion groups from a JSONL file (core/data.h),
// with an optional frozen reference model (--ref_model).
#include <unistd.h>

#include <algorithm>
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
#include "core/presets.h"
#include "core/trainer.h"
#include "examples/common.h"
#include "examples/report.h"

ABSL_FLAG(std::string, data, "",
          "sft: token data, headerless .bin (see --data_dtype) or .jsonl; empty = synthetic task. dpo, grpo: the "
          "objective's JSONL file (required)");
ABSL_FLAG(std::string, data_dtype, "uint16", "element type of a .bin token file: uint16 or uint32");
ABSL_FLAG(int64_t, seq_len, 4096, "sft: tokens per sequence (dpo and grpo take their sequences whole from --data)");
ABSL_FLAG(int64_t, steps, 300, "optimizer steps");
ABSL_FLAG(int64_t, batch, 1, "sequences (sft), pairs (dpo) or groups (grpo) per step, cycling through --data");
ABSL_FLAG(std::string, ref_model, "",
          "dpo, grpo: frozen reference model (preset or Hugging Face directory, loaded like --model) for the reference "
          "log-probs that --data does not carry");
ABSL_FLAG(double, lr, 3e-3, "AdamW learning rate");
ABSL_FLAG(double, weight_decay, 0.0, "AdamW decoupled weight decay");
ABSL_FLAG(std::string, report, "", "write a JSON report here");
ABSL_FLAG(std::string, save, "",
          "save the trained model (HF config.json + model.safetensors) to this directory; with LoRA, the PEFT adapter "
          "(adapter_config.json + adapter_model.safetensors) unless --merge_lora");
ABSL_FLAG(bool, merge_lora, false,
          "with LoRA: save the base model with the adapters merged (W + alpha/r B A), a plain HF model, instead of "
          "the adapter files");

namespace sg {
namespace {

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

// Training data of any objective, handed out --batch records at a time, cycling.
struct TrainData {
  std::vector<Sequence> sequences;  // sft from a file
  RetrievalTask task;               // sft without a file
  std::vector<DpoPair> pairs;       // dpo
  std::vector<GrpoGroup> groups;    // grpo
  int64_t next = 0;

  // The next batch and the tokens it holds (every sequence's inputs).
  Batch Next(const std::string& objective, int64_t batch_size, uint64_t seed, int64_t* tokens) {
    Batch b;
    *tokens = 0;
    for (int64_t i = 0; i < batch_size; ++i, ++next) {
      if (objective == "dpo") {
        b.pairs.push_back(pairs[next % pairs.size()]);
        *tokens += static_cast<int64_t>(b.pairs.back().chosen.ids.size() + b.pairs.back().rejected.ids.size());
      } else if (objective == "grpo") {
        b.groups.push_back(groups[next % groups.size()]);
        for (const GrpoCompletion& c : b.groups.back().completions) *tokens += static_cast<int64_t>(c.seq.ids.size());
      } else {
        b.sequences.push_back(sequences.empty() ? task.Make(seed, next) : sequences[next % sequences.size()]);
        *tokens += static_cast<int64_t>(b.sequences.back().ids.size());
      }
    }
    return b;
  }
};

// dpo / grpo: loads --data and checks that every reference log-prob the trainer will need is in the data or can
// come from the reference model. Returns the longest sequence and a description of the data.
void LoadObjectiveData(const ObjectiveOptions& objective, const std::string& path, int64_t vocab,
                       bool have_reference, TrainData* d, int64_t* longest, std::string* what) {
  *longest = 0;
  int64_t lacking = 0, records = 0;
  if (objective.name == "dpo") {
    absl::StatusOr<std::vector<DpoPair>> loaded = LoadDpoJsonl(path, vocab);
    tools::ExitIfError(loaded.status(), "--data");
    d->pairs = std::move(*loaded);
    for (const DpoPair& p : d->pairs) {
      lacking += std::isnan(p.ref_chosen_logp);
      *longest = std::max<int64_t>({*longest, static_cast<int64_t>(p.chosen.ids.size()),
                                    static_cast<int64_t>(p.rejected.ids.size())});
    }
    records = static_cast<int64_t>(d->pairs.size());
    *what = absl::StrCat(records, " pairs");
    if (lacking > 0 && !have_reference)
      tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(
                             lacking, " of ", records, " pairs in ", path,
                             " have no ref_chosen_logp / ref_rejected_logp: give --ref_model (a frozen reference "
                             "model) or add them to the data")),
                         "--data");
  } else {
    absl::StatusOr<std::vector<GrpoGroup>> loaded = LoadGrpoJsonl(path, vocab);
    tools::ExitIfError(loaded.status(), "--data");
    d->groups = std::move(*loaded);
    for (const GrpoGroup& g : d->groups)
      for (const GrpoCompletion& c : g.completions) {
        ++records;
        lacking += c.ref_logprobs.empty();
        *longest = std::max<int64_t>(*longest, static_cast<int64_t>(c.seq.ids.size()));
      }
    *what = absl::StrCat(d->groups.size(), " groups, ", records, " completions");
    if (objective.grpo_kl_beta > 0 && lacking > 0 && !have_reference)
      tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(
                             lacking, " of ", records, " completions in ", path,
                             " have no ref_logprobs and --grpo_kl_beta > 0: give --ref_model (a frozen reference "
                             "model), add ref_logprobs to the data, or set --grpo_kl_beta=0")),
                         "--data");
  }
}

int Main() {
  const int64_t seq_len = absl::GetFlag(FLAGS_seq_len);
  if (seq_len <= 0) tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", seq_len)), "flags");
  if (absl::GetFlag(FLAGS_steps) <= 0) tools::ExitIfError(absl::InvalidArgumentError("--steps must be positive"), "flags");
  if (absl::GetFlag(FLAGS_batch) <= 0) tools::ExitIfError(absl::InvalidArgumentError("--batch must be positive"), "flags");
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  const StrategyOptions strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(strategy), "flags");
  const ObjectiveOptions objective = tools::ObjectiveFromFlags();
  tools::ExitIfError(ValidateObjectiveOptions(objective), "flags");
  const bool sft = objective.name == "sft";
  const std::string data = absl::GetFlag(FLAGS_data);
  const std::string ref_model = absl::GetFlag(FLAGS_ref_model);
  if (!sft && data.empty())
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(
                           "--objective=", objective.name, " needs --data: a JSONL file of ",
                           objective.name == "dpo" ? "preference pairs" : "prompts with scored completions",
                           " (format: README, \"Objectives: SFT, DPO, GRPO\")")),
                       "flags");
  if (sft && !ref_model.empty())
    tools::ExitIfError(absl::InvalidArgumentError("--ref_model is used only by --objective=dpo and grpo"), "flags");

  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<std::unique_ptr<Model>> model = LoadAnyModel(tools::ModelSpec(), *dtype, seed);
  tools::ExitIfError(model.status(), "--model");
  const std::string lora = tools::ApplyLoraFlags(**model);  // --lora_*: adapters on, base frozen
  if (lora.empty() && absl::GetFlag(FLAGS_merge_lora))
    tools::ExitIfError(absl::InvalidArgumentError("--merge_lora needs LoRA (--lora_rank or --lora_init)"), "flags");
  const int64_t vocab = (*model)->vocab_size();
  // The frozen reference: a preset gets the same seed, so it starts equal to the policy.
  std::unique_ptr<Model> reference;
  if (!ref_model.empty()) {
    absl::StatusOr<std::unique_ptr<Model>> r = LoadAnyModel(tools::ModelSpecOf(ref_model), *dtype, seed);
    tools::ExitIfError(r.status(), "--ref_model");
    if ((*r)->vocab_size() != vocab)
      tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("vocabulary size ", (*r)->vocab_size(),
                                                                 " differs from --model's ", vocab)),
                         "--ref_model");
    reference = std::move(*r);
  }

  // Data: a file, or (sft) the synthetic task generated on the fly.
  TrainData train_data;
  int64_t report_seq_len = seq_len;  // dpo, grpo: the longest sequence of the data
  std::string data_what = data.empty() ? "synthetic retrieval" : data;
  if (!sft) {
    std::string what;
    LoadObjectiveData(objective, tools::ResolveUserPath(data), vocab, reference != nullptr, &train_data,
                      &report_seq_len, &what);
    absl::StrAppend(&data_what, " (", what, ")");
  } else if (!data.empty()) {
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
    train_data.sequences = std::move(*loaded);
  } else {
    train_data.task.seq_len = seq_len;
    train_data.task.vocab = vocab;
    tools::ExitIfError(train_data.task.Validate(), "synthetic task");
  }

  OptimizerOptions opt;
  opt.lr = absl::GetFlag(FLAGS_lr);
  opt.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  Trainer trainer(**model, strategy, opt, objective, reference.get());
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  // Progress line, per-step metrics, held-out evaluation and the report's plots (examples/report.h).
  tools::TrainMonitor monitor(trainer, steps);
  tools::ExitIfError(monitor.SetUpEval(objective.name, sft && data.empty() ? &train_data.task : nullptr, seed, seq_len,
                                       absl::GetFlag(FLAGS_data_dtype)),
                     "evaluation");
  std::fprintf(stderr,
               "seqgrad train: model=%s objective=%s strategy=%s seq_len=%lld chunk=%lld steps=%lld data=%s%s\n",
               absl::GetFlag(FLAGS_model).c_str(), objective.name.c_str(), strategy.name.c_str(),
               static_cast<long long>(report_seq_len), static_cast<long long>(strategy.chunk),
               static_cast<long long>(steps), data_what.c_str(),
               ref_model.empty() ? "" : absl::StrCat(" ref_model=", ref_model).c_str());
  if (!lora.empty()) std::fprintf(stderr, "%s\n", lora.c_str());

  std::vector<double> losses;
  int64_t tokens = 0;
  double seconds = 0;
  for (int64_t step = 1; step <= steps; ++step) {
    int64_t batch_tokens = 0;
    const Batch batch = train_data.Next(objective.name, absl::GetFlag(FLAGS_batch), seed, &batch_tokens);
    monitor.BeginStep(step);
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepMetrics> m = sft ? trainer.Step(batch.sequences) : trainer.Step(batch);
    const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    seconds += step_seconds;
    tools::ExitIfError(m.status(), absl::StrCat("step ", step).c_str());
    tokens += batch_tokens;
    losses.push_back(m->loss);
    monitor.EndStep(step, *m, opt.lr, batch_tokens, step_seconds, tokens / seconds);
  }
  monitor.FinishProgress();

  const MemorySnapshot mem = (*model)->memory().Snapshot();
  std::printf("done: %lld steps, %s loss %.4f -> %.4f, %.0f tokens/s, peak %s\n", static_cast<long long>(steps),
              objective.name.c_str(), losses.front(), losses.back(), tokens / seconds, Mib(mem.total_peak).c_str());
  for (int i = 0; i < kNumMemCategories; ++i)
    std::printf("  peak %-12s %s\n", MemCategoryName(static_cast<MemCategory>(i)), Mib(mem.peak[i]).c_str());
  monitor.PrintEvalSummary(stdout);

  if (const std::string save = absl::GetFlag(FLAGS_save); !save.empty())
    tools::ExitIfError(tools::SaveTrained(**model, tools::ResolveUserPath(save), tools::ModelSpec(),
                                          absl::GetFlag(FLAGS_merge_lora)),
                       "--save");
  if (const std::string report = absl::GetFlag(FLAGS_report); !report.empty()) {
    std::string losses_json;
    for (size_t i = 0; i < losses.size(); ++i) absl::StrAppend(&losses_json, i ? ", " : "", absl::StrFormat("%.6f", losses[i]));
    const std::string json = absl::StrFormat(
        "{\"model\": \"%s\", \"objective\": \"%s\", \"strategy\": \"%s\", \"seq_len\": %d, \"chunk\": %d, "
        "\"steps\": %d, \"loss_first\": %.6f, \"loss_last\": %.6f, \"tokens_per_s\": %.1f, \"peak_bytes\": %d, "
        "\"peak_bytes_by_category\": %s, \"lora\": %s, \"losses\": [%s]}\n",
        absl::GetFlag(FLAGS_model), objective.name, strategy.name, report_seq_len, strategy.chunk, steps,
        losses.front(), losses.back(), tokens / seconds, mem.total_peak, tools::PeakByCategoryJson(mem), tools::LoraJson(**model),
        losses_json);
    tools::ExitIfError(monitor.WriteReport(tools::ResolveUserPath(report), json), "--report");
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
