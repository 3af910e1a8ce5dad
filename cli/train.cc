// The main job: trains a model with a chosen strategy. With no flags it trains the embedded default, a small
// Llama-shaped model on the synthetic long-range retrieval task, in about two minutes on two cores.
// --objective=dpo|grpo trains on preference pairs / scored completion groups from a JSONL file (core/data.h),
// with an optional frozen reference model (--ref_model).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/communicator.h"
#include "cli/common.h"
#include "cli/report.h"
#include "core/checkpoint.h"
#include "core/data.h"
#include "core/lr_schedule.h"
#include "core/model_io.h"
#include "core/models/transformer/transformer.h"
#include "core/trainer.h"
#include "distributed/data_parallel.h"
#include "distributed/host_staged_nccl.h"
#include "distributed/layer_sharded.h"
#include "distributed/mpi_plugin.h"
#include "distributed/tensor_parallel.h"

ABSL_FLAG(std::string, data, "",
          "sft: token data, headerless .bin (see --data_dtype) or .jsonl; empty = synthetic task. dpo, grpo: the "
          "objective's JSONL file (required)");
ABSL_FLAG(std::string, data_dtype, "uint16", "element type of a .bin token file: uint16 or uint32");
ABSL_FLAG(int64_t, seq_len, 4096, "sft: tokens per sequence (dpo and grpo take their sequences whole from --data)");
ABSL_FLAG(int64_t, steps, 300, "optimizer steps");
ABSL_FLAG(int64_t, batch, 1, "sequences (sft), pairs (dpo) or groups (grpo) per step, cycling through --data");
ABSL_FLAG(std::string, ref_model, "",
          "dpo, grpo: frozen reference model (preset or Hugging Face directory, loaded like --model) for the reference "
          "log-probs that --data does not carry; '@base' with LoRA: --model itself with its adapters off (no second "
          "model)");
ABSL_FLAG(std::string, report, "", "write a JSON report here");
ABSL_FLAG(std::string, save, "",
          "save the trained model (HF config.json + model.safetensors) to this directory; with LoRA, the PEFT adapter "
          "(adapter_config.json + adapter_model.safetensors) unless --merge_lora");
ABSL_FLAG(std::string, save_dtype, "",
          "--save and --out_dir's final model: the weights as the model stores them (empty, the default: a "
          "--dtype=bf16 model saves bf16 matrices), or f32 (every tensor in f32), or bf16 (--dtype=bf16 models); "
          "checkpoints keep the stored dtype, LoRA adapters are f32");
ABSL_FLAG(bool, merge_lora, false,
          "with LoRA: save the base model with the adapters merged (W + alpha/r B A), a plain HF model, instead of "
          "the adapter files");
// The trainer options of train only (cabi/trainer_options.inc): the optimizer's.
#define SG_CLI_FLAG_Tools SG_CLI_SKIP
#define SG_CLI_FLAG_Train SG_CLI_DEFINE_FLAG
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_CLI_OPTION(FLAG, name, kind, engine, cli, doc)
#include "cabi/trainer_options.inc"

ABSL_FLAG(std::string, out_dir, "",
          "write checkpoints here (checkpoint-<step>/: every --save_every steps and after the last step) and the "
          "final model (like --save)");
ABSL_FLAG(int64_t, save_every, 0, "with --out_dir: also save a checkpoint every N steps (0 = only after the last)");
ABSL_FLAG(bool, resume, false,
          "continue from the newest complete checkpoint in --out_dir; refused when the run's configuration differs");
ABSL_FLAG(int64_t, keep_checkpoints, 2, "checkpoints kept in --out_dir: the newest N (0 = all)");
ABSL_FLAG(int64_t, stop_at_step, 0,
          "stop after this step as if interrupted (a checkpoint is saved there with --out_dir; continue with "
          "--resume): time-limited jobs; the schedule still ends at --steps. 0 = run to --steps");
ABSL_FLAG(std::string, dist, "",
          "data parallel across the ranks of an mpirun job: 'mpi' (each rank takes its share of every step's "
          "records; gradients are all-reduced once per parameter; rank 0 prints, reports and saves) or 'nccl' (the "
          "same over NCCL, one GPU per rank, host buffers staged through the GPU; needs a --config=cuda build). "
          "Empty: one process");
ABSL_FLAG(bool, dist_layers, false,
          "with --dist=mpi and --strategy=adjoint (SSMs, sft): layer-sharded adjoint instead of data parallel: each "
          "rank owns a contiguous block of layers and the chunks flow through the ranks as a pipeline "
          "(distributed/layer_sharded.h); every rank sees every record. Not with --out_dir (each rank holds only its "
          "own optimizer moments)");
ABSL_FLAG(bool, dist_shard_optimizer, false,
          "with --dist=mpi (data parallel): ZeRO-1, each rank keeps AdamW moments only for its share of the "
          "parameters and broadcasts them after its step. Not with --out_dir");
ABSL_FLAG(int, tp, 1,
          "with --dist: tensor parallel over groups of this many ranks (transformers: heads, KV heads, SwiGLU width "
          "and vocabulary split; Mamba: d_inner channels and vocabulary; docs/distributed.md); the job's "
          "ranks form tp x (ranks / tp) data-parallel "
          "groups. Checkpoints and saves hold the whole model");
ABSL_FLAG(int64_t, memory_budget, 0,
          "bytes: before starting, pick the largest --chunk (seco, spaco, adjoint) or partition (streambp) whose "
          "step fits, probed with the engine's memory limit, or refuse with the numbers (0 = no budget)");

namespace sg {
namespace {

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

// train's flags that the list gives the engine struct Engine as they are.
template <typename Engine>
void CopyTrainFlags(Engine* to){
#define SG_CLI_COPY_Tools SG_CLI_SKIP
#define SG_CLI_COPY_Train SG_CLI_COPY_FLAG
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_CLI_OPTION(COPY, name, kind, engine, cli, doc)
#include "cabi/trainer_options.inc"
}

// The optimizer's flags; the decay ends at --steps.
OptimizerOptions OptimizerFromFlags() {
  OptimizerOptions o;
  CopyTrainFlags(&o);
  o.total_steps = absl::GetFlag(FLAGS_steps);
  if (o.lr_schedule != "constant" && o.total_steps <= o.warmup_steps)
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(
                           "--lr_schedule=", o.lr_schedule, " decays after --warmup_steps=", o.warmup_steps,
                           " until --steps=", o.total_steps, ": --steps must be larger")),
                       "flags");
  if (absl::Status s = ValidateOptimizerOptions(o); !s.ok())  // messages start with the option's name
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--", s.message())), "flags");
  return o;
}

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

// --memory_budget's probe: the longest sequence the run will see.
Sequence LongestSequence(const TrainData& d, const std::string& objective, uint64_t seed) {
  const Sequence* best = nullptr;
  auto consider = [&](const Sequence& s) {
    if (!best || s.ids.size() > best->ids.size()) best = &s;
  };
  if (objective == "dpo") {
    for (const DpoPair& p : d.pairs) {
      consider(p.chosen);
      consider(p.rejected);
    }
  } else if (objective == "grpo") {
    for (const GrpoGroup& g : d.groups)
      for (const GrpoCompletion& c : g.completions) consider(c.seq);
  } else {
    for (const Sequence& s : d.sequences) consider(s);
  }
  if (!best) return d.task.Make(seed, 0);  // the synthetic task: every sequence has seq_len tokens
  return Sequence{best->ids, best->labels, nullptr};
}

// dpo / grpo: loads --data and checks that every reference log-prob the trainer will need is in the data or can
// come from the reference model. Returns the longest sequence and a description of the data.
void LoadObjectiveData(const ObjectiveOptions& objective, const std::string& path, int64_t vocab, bool have_reference,
                       TrainData* d, int64_t* longest, std::string* what) {
  *longest = 0;
  int64_t lacking = 0, records = 0;
  if (objective.name == "dpo") {
    absl::StatusOr<std::vector<DpoPair>> loaded = LoadDpoJsonl(path, vocab, absl::GetFlag(FLAGS_max_line_bytes));
    tools::ExitIfError(loaded.status(), "--data");
    d->pairs = std::move(*loaded);
    for (const DpoPair& p : d->pairs) {
      lacking += std::isnan(p.ref_chosen_logp);
      *longest = std::max<int64_t>(
          {*longest, static_cast<int64_t>(p.chosen.ids.size()), static_cast<int64_t>(p.rejected.ids.size())});
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
    absl::StatusOr<std::vector<GrpoGroup>> loaded = LoadGrpoJsonl(path, vocab, absl::GetFlag(FLAGS_max_line_bytes));
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

// What the phases of a run share. Members are declared in the order the phases set them up, so that they are torn
// down in reverse (the grid's communicators before the job's, the trainer before its model).
struct TrainRun {
  // JoinJob: --dist and --tp.
  std::unique_ptr<dist::Communicator> comm;
  std::string dist_what;  // "--dist=<flag>": names the job's collective errors
  bool lead = true;       // prints, reports, saves
  std::optional<dist::TensorParallelGrid> grid;
  dist::Communicator* dp_comm = nullptr;  // data parallelism runs across the tensor-parallel groups

  // CheckFlags.
  int64_t seq_len = 0, steps = 0, batch = 0;
  Overlong overlong = Overlong::kTruncate;
  DType dtype = DType::kF32;
  Device device = Device::kCPU;
  StrategyOptions strategy;
  ObjectiveOptions objective;
  OptimizerOptions opt;
  std::string out_dir;
  int64_t save_every = 0, keep = 0, memory_budget = 0, stop_at_step = 0;
  bool resume = false, sft = true;
  std::string data, ref_model;
  uint64_t seed = 0;

  // LoadModels.
  std::unique_ptr<Model> model;
  std::string lora;  // ApplyLoraFlags's description, "" without LoRA
  bool merge_lora = false;
  SaveDType save_dtype;
  std::unique_ptr<Model> reference;
  bool reference_is_base = false;

  // LoadTrainData.
  TrainData train_data;
  int64_t report_seq_len = 0;  // dpo, grpo: the longest sequence of the data
  std::string data_what;

  // Preflight.
  std::string save_dir;

  // SetUpParallelism.
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<dist::DataParallel> data_parallel;
  std::unique_ptr<dist::LayerShardedAdjoint> layer_sharded;
  bool shard_optimizer = false;

  // BuildRunConfig, StartMonitor.
  std::optional<dist::WholeTrainer> meta_whole;
  RunConfig run_config;
  std::unique_ptr<tools::TrainMonitor> monitor;

  // ResumeFromCheckpoint, TrainSteps.
  // Per-step series (kept in checkpoints, so that a resumed run reports its whole curve).
  std::map<std::string, std::vector<double>> history;
  int64_t first_step = 1, last_step = 0;
  int64_t tokens = 0, tp_bytes_last_step = 0;
  double seconds = 0;
};

// --dist=mpi: joins the job first, so that every later error is a rank's own. False when a rank's stdout cannot be
// silenced.
bool JoinJob(TrainRun& run) {
  const std::string dist_flag = absl::GetFlag(FLAGS_dist);
  run.dist_what = absl::StrCat("--dist=", dist_flag);
  if (dist_flag == "mpi" || dist_flag == "nccl") {
    absl::StatusOr<std::unique_ptr<dist::Communicator>> c =
        dist_flag == "mpi" ? dist::JoinMpiJob(run.dist_what) : dist::CreateHostStagedNcclCommunicator();
    tools::ExitIfError(c.status(), run.dist_what.c_str());
    run.comm = std::move(*c);
    if (run.comm->rank() != 0) {  // rank 0 prints; the others keep stderr for their errors
      if (!std::freopen("/dev/null", "w", stdout)) return false;
    }
  } else if (!dist_flag.empty()) {
    tools::ExitIfError(
        absl::InvalidArgumentError(absl::StrCat("--dist must be empty, mpi or nccl, got '", dist_flag, "'")), "flags");
  }
  run.lead = !run.comm || run.comm->rank() == 0;
  // --tp: the ranks form tensor-parallel groups; data parallelism runs across them (over `dp_comm`).
  const int tp = absl::GetFlag(FLAGS_tp);
  if (run.comm) tools::ExitIfError(dist::CheckSameTp(*run.comm, tp), "--tp");
  if (tp != 1) {
    if (!run.comm) tools::ExitIfError(absl::InvalidArgumentError("needs --dist=mpi or --dist=nccl"), "--tp");
    absl::StatusOr<dist::TensorParallelGrid> g = dist::CreateTensorParallelGrid(*run.comm, tp);
    tools::ExitIfError(g.status(), "--tp");
    run.grid = std::move(*g);
  }
  run.dp_comm = run.grid ? run.grid->dp.get() : run.comm.get();
  return true;
}

// The flags that need no model, checked before anything is loaded.
void CheckFlags(TrainRun& run) {
  run.seq_len = absl::GetFlag(FLAGS_seq_len);
  if (run.seq_len <= 0)
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--seq_len must be positive, got ", run.seq_len)),
                       "flags");
  const absl::StatusOr<Overlong> overlong = ParseOverlong(absl::GetFlag(FLAGS_overlong));
  tools::ExitIfError(overlong.status(), "flags");
  run.overlong = *overlong;
  run.steps = absl::GetFlag(FLAGS_steps);
  if (run.steps <= 0) tools::ExitIfError(absl::InvalidArgumentError("--steps must be positive"), "flags");
  run.batch = absl::GetFlag(FLAGS_batch);
  if (run.batch <= 0) tools::ExitIfError(absl::InvalidArgumentError("--batch must be positive"), "flags");
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  run.dtype = *dtype;
  run.device = tools::DeviceFromFlags();
  run.strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(run.strategy), "flags");
  run.objective = tools::ObjectiveFromFlags();
  tools::ExitIfError(ValidateObjectiveOptions(run.objective), "flags");
  run.opt = OptimizerFromFlags();
  // Checkpoints and the memory budget.
  run.out_dir = tools::ResolveUserPath(absl::GetFlag(FLAGS_out_dir));
  run.save_every = absl::GetFlag(FLAGS_save_every);
  run.keep = absl::GetFlag(FLAGS_keep_checkpoints);
  run.resume = absl::GetFlag(FLAGS_resume);
  run.memory_budget = absl::GetFlag(FLAGS_memory_budget);
  run.stop_at_step = absl::GetFlag(FLAGS_stop_at_step);
  if (run.stop_at_step < 0)
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--stop_at_step must be >= 0, got ", run.stop_at_step)),
                       "flags");
  if (run.save_every < 0)
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--save_every must be >= 0, got ", run.save_every)),
                       "flags");
  if (run.keep < 0 || run.keep > 1000000)
    tools::ExitIfError(
        absl::InvalidArgumentError(absl::StrCat("--keep_checkpoints must be >= 0 (0 = all), got ", run.keep)), "flags");
  if (run.out_dir.empty() && (run.save_every > 0 || run.resume))
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(run.resume ? "--resume" : "--save_every",
                                                               " needs --out_dir (where checkpoints live)")),
                       "flags");
  if (run.memory_budget < 0)
    tools::ExitIfError(
        absl::InvalidArgumentError(absl::StrCat("--memory_budget must be >= 0 bytes, got ", run.memory_budget)),
        "flags");
  run.sft = run.objective.name == "sft";
  run.data = absl::GetFlag(FLAGS_data);
  run.ref_model = absl::GetFlag(FLAGS_ref_model);
  if (!run.sft && run.data.empty())
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat(
                           "--objective=", run.objective.name, " needs --data: a JSONL file of ",
                           run.objective.name == "dpo" ? "preference pairs" : "prompts with scored completions",
                           " (format: docs/objectives.md)")),
                       "flags");
  if (run.sft && !run.ref_model.empty())
    tools::ExitIfError(absl::InvalidArgumentError("--ref_model is used only by --objective=dpo and grpo"), "flags");
  run.seed = absl::GetFlag(FLAGS_seed);
}

// --model (LoRA on it) and the frozen reference. --tp: every rank loads the whole model into host memory and keeps
// only its own blocks on the device.
void LoadModels(TrainRun& run) {
  const Device load_device = run.grid ? Device::kCPU : run.device;
  absl::StatusOr<std::unique_ptr<Model>> model =
      LoadAnyModel(tools::ModelSpec(), run.dtype, run.seed, load_device, tools::LoraRequested(),
                   run.strategy.offload_experts && !run.grid);  // experts made in host memory
  tools::ExitIfError(model.status(), "--model");
  run.lora = tools::ApplyLoraFlags(**model);  // --lora_*: adapters on, base frozen
  if (run.grid) {
    model = dist::SplitModel(**model, run.grid->layers(), run.device);
    tools::ExitIfError(model.status(), "--tp");
  }
  run.model = std::move(*model);
  tools::ExitIfError(ValidateStrategyForModel(run.strategy, *run.model), "flags");  // e.g. --offload_experts
  run.merge_lora = absl::GetFlag(FLAGS_merge_lora);
  if (run.lora.empty() && run.merge_lora)
    tools::ExitIfError(absl::InvalidArgumentError("--merge_lora needs LoRA (--lora_rank or --lora_init)"), "flags");
  absl::StatusOr<SaveDType> save_dtype = ParseSaveDType(absl::GetFlag(FLAGS_save_dtype));
  tools::ExitIfError(save_dtype.status(), "flags");
  run.save_dtype = *save_dtype;
  tools::ExitIfError(CheckSaveDType(*run.model, run.save_dtype), "flags");  // before training, not after it
  if (run.save_dtype && !run.lora.empty() && !run.merge_lora)
    tools::ExitIfError(absl::InvalidArgumentError("--save_dtype: LoRA saves the adapters, which are f32; add "
                                                  "--merge_lora to save the merged model in a chosen dtype"),
                       "flags");
  // The frozen reference: a preset gets the same seed, so it starts equal to the policy.
  run.reference_is_base = run.ref_model == "@base";
  if (run.reference_is_base && run.lora.empty())
    tools::ExitIfError(absl::InvalidArgumentError("'@base' (the model without its adapters) needs LoRA (--lora_rank "
                                                  "or --lora_init): without adapters it is the policy itself"),
                       "--ref_model");
  if (run.ref_model.empty() || run.reference_is_base) return;
  absl::StatusOr<std::unique_ptr<Model>> r =
      LoadAnyModel(tools::ModelSpecOf(run.ref_model), run.dtype, run.seed, load_device, /*frozen_base=*/true);
  tools::ExitIfError(r.status(), "--ref_model");
  if (run.grid) {
    r = dist::SplitModel(**r, run.grid->layers(), run.device);
    tools::ExitIfError(r.status(), "--ref_model");
  }
  const int64_t vocab = run.model->vocab_size();
  if ((*r)->vocab_size() != vocab)
    tools::ExitIfError(absl::InvalidArgumentError(
                           absl::StrCat("vocabulary size ", (*r)->vocab_size(), " differs from --model's ", vocab)),
                       "--ref_model");
  run.reference = std::move(*r);
}

// Data: a file, or (sft) the synthetic task generated on the fly.
void LoadTrainData(TrainRun& run) {
  const int64_t vocab = run.model->vocab_size();
  run.report_seq_len = run.seq_len;
  run.data_what = run.data.empty() ? "synthetic retrieval" : run.data;
  if (!run.sft) {
    std::string what;
    LoadObjectiveData(run.objective, tools::ResolveUserPath(run.data), vocab, !run.ref_model.empty(), &run.train_data,
                      &run.report_seq_len, &what);
    absl::StrAppend(&run.data_what, " (", what, ")");
  } else if (!run.data.empty()) {
    const std::string path = tools::ResolveUserPath(run.data);
    absl::StatusOr<std::vector<Sequence>> loaded;
    if (absl::EndsWith(path, ".jsonl")) {
      JsonlCounts counts;
      loaded = LoadJsonl(path, run.seq_len, vocab, absl::GetFlag(FLAGS_max_line_bytes), run.overlong, &counts);
      if (loaded.ok()) absl::StrAppend(&run.data_what, " (", counts.Summary(), ")");
    } else {
      const std::string t = absl::GetFlag(FLAGS_data_dtype);
      if (t != "uint16" && t != "uint32")
        tools::ExitIfError(absl::InvalidArgumentError("--data_dtype must be uint16 or uint32"), "flags");
      loaded = LoadTokenBin(path, t == "uint16" ? 2 : 4, run.seq_len, vocab, absl::GetFlag(FLAGS_doc_sep_token));
    }
    tools::ExitIfError(loaded.status(), "--data");
    run.train_data.sequences = std::move(*loaded);
  } else {
    run.train_data.task.seq_len = run.seq_len;
    run.train_data.task.vocab = vocab;
    tools::ExitIfError(run.train_data.task.Validate(), "synthetic task");
  }
}

// Before the first step: the device's memory, what --save and --out_dir will write, and --memory_budget.
void Preflight(TrainRun& run) {
  Model& model = *run.model;
  {
    const Sequence probe = LongestSequence(run.train_data, run.objective.name, run.seed);
    tools::ExitIfError(tools::CheckDeviceMemory(model, run.strategy, static_cast<int64_t>(probe.ids.size())),
                       "--device");
  }
  // Checked now rather than after the last step.
  run.save_dir = tools::ResolveUserPath(absl::GetFlag(FLAGS_save));
  if (run.lead && !run.save_dir.empty())
    tools::ExitIfError(tools::CheckSaveTrained(model, run.save_dir, tools::ModelSpec(), run.merge_lora), "--save");
  if (run.lead && !run.out_dir.empty()) {
    std::error_code ignored;  // where it cannot be created, the check says why
    std::filesystem::create_directories(run.out_dir, ignored);
    tools::ExitIfError(tools::CheckSaveTrained(model, run.out_dir, tools::ModelSpec(), run.merge_lora), "--out_dir");
  }
  // --memory_budget: the largest chunk / partition whose step fits (weights, gradients and optimizer state
  // included), before anything is trained.
  if (run.memory_budget <= 0) return;
  const Sequence probe = LongestSequence(run.train_data, run.objective.name, run.seed);
  absl::StatusOr<BudgetFit> fit =
      FitMemoryBudget(model, run.strategy, probe, run.memory_budget, AdamW::StateBytes(model));
  tools::ExitIfError(fit.status(), "--memory_budget");
  if (fit->chunked) run.strategy.chunk = fit->chunk;
  std::string tried;
  for (const auto& [chunk, peak] : fit->probes)
    absl::StrAppend(&tried, tried.empty() ? "" : ", ", chunk, peak < 0 ? " over" : absl::StrCat(" ", Mib(peak)));
  std::fprintf(stderr, "memory budget %s: %s (peak %s; tried %s)\n", Mib(run.memory_budget).c_str(),
               fit->chunked ? absl::StrCat("--chunk=", fit->chunk).c_str() : "fits", Mib(fit->peak_bytes).c_str(),
               tried.c_str());
}

// The trainer, and over a job either the layer-sharded adjoint (--dist_layers) or data parallelism.
void SetUpParallelism(TrainRun& run) {
  run.trainer = std::make_unique<Trainer>(*run.model, run.strategy, run.opt, run.objective, run.reference.get());
  if (run.reference_is_base) run.trainer->set_reference_base_model();
  const bool dist_layers = absl::GetFlag(FLAGS_dist_layers);
  run.shard_optimizer = absl::GetFlag(FLAGS_dist_shard_optimizer);
  const char* dist_what = dist_layers ? "--dist_layers" : "--dist_shard_optimizer";
  if (dist_layers && run.grid)
    tools::ExitIfError(absl::InvalidArgumentError("layer sharding and --tp split the model two ways: pick one"),
                       dist_what);
  if ((dist_layers || run.shard_optimizer) && !run.comm)
    tools::ExitIfError(absl::InvalidArgumentError("needs --dist=mpi or --dist=nccl"), dist_what);
  if ((dist_layers || run.shard_optimizer) && !run.out_dir.empty())
    tools::ExitIfError(absl::InvalidArgumentError("checkpoints (--out_dir) would hold only rank 0's optimizer moments"),
                       dist_what);
  if (dist_layers && run.shard_optimizer)
    tools::ExitIfError(absl::InvalidArgumentError("layer sharding already shards the optimizer by layer: drop "
                                                  "--dist_shard_optimizer"),
                       dist_what);
  if (dist_layers) {
    if (run.objective.name != "sft")
      tools::ExitIfError(
          absl::InvalidArgumentError(absl::StrCat("trains sft only, not --objective=", run.objective.name)), dist_what);
    run.layer_sharded = std::make_unique<dist::LayerShardedAdjoint>(*run.model, run.strategy, run.opt, *run.comm);
    tools::ExitIfError(run.layer_sharded->Validate(), dist_what);
  } else if (run.comm) {
    run.data_parallel = std::make_unique<dist::DataParallel>(*run.trainer, *run.dp_comm);
    run.data_parallel->set_shard_optimizer(run.shard_optimizer);
  }
}

// What a resume must match (core/checkpoint.h): model, LoRA, strategy, optimizer, objective, and the data.
// --tp: the whole model's configuration (a meta twin), so that checkpoints resume across tp and one process.
void BuildRunConfig(TrainRun& run) {
  if (run.grid) {
    absl::StatusOr<dist::WholeTrainer> w = dist::MakeWholeTrainer(*run.trainer, Device::kMeta);
    tools::ExitIfError(w.status(), "--tp");
    run.meta_whole = std::move(*w);
  }
  RunConfig& config = run.run_config;
  config = TrainerRunConfig(run.grid ? *run.meta_whole->trainer : *run.trainer);
  config["data"] = run.data.empty() ? "synthetic retrieval" : tools::ResolveUserPath(run.data);
  if (run.sft) config["seq_len"] = absl::StrCat(run.seq_len);
  if (run.sft && !run.data.empty() && !absl::EndsWith(run.data, ".jsonl"))
    config["data_dtype"] = absl::GetFlag(FLAGS_data_dtype);
  // Separators change the sequences a step trains (none: no field, older checkpoints resume).
  if (run.sft && !run.data.empty() && !absl::EndsWith(run.data, ".jsonl") && absl::GetFlag(FLAGS_doc_sep_token) >= 0)
    config["doc_sep_token"] = absl::StrCat(absl::GetFlag(FLAGS_doc_sep_token));
  // Splitting changes the records a data position counts (truncation keeps them: no field, older checkpoints resume).
  if (run.sft && absl::EndsWith(run.data, ".jsonl") && run.overlong == Overlong::kSplit) config["overlong"] = "split";
  config["batch"] = absl::StrCat(run.batch);
  if (!run.ref_model.empty())
    config["ref_model"] = run.reference_is_base ? run.ref_model : tools::ModelSpecOf(run.ref_model);
  if (run.comm) {  // every rank must train the same model the same way on the same data
    // Not part of run_config: a data-parallel step equals one process's, so checkpoints resume across world sizes.
    // Ranks may run with different thread counts (runtime.*).
    RunConfig shared = config;
    shared.erase(absl::StrCat(kRuntimePrefix, "threads"));
    tools::ExitIfError(dist::CheckSameConfig(*run.comm, shared), run.dist_what.c_str());
  }
}

// Progress line, per-step metrics, held-out evaluation and the report's plots (cli/report.h); then the run's header.
void StartMonitor(TrainRun& run) {
  run.monitor = std::make_unique<tools::TrainMonitor>(*run.trainer, run.steps);
  tools::ExitIfError(
      run.monitor->SetUpEval(run.objective.name, run.sft && run.data.empty() ? &run.train_data.task : nullptr, run.seed,
                             run.seq_len, absl::GetFlag(FLAGS_data_dtype)),
      "evaluation");
  if (run.lead)
    std::fprintf(stderr,
                 "seqgrad train: model=%s objective=%s strategy=%s seq_len=%lld chunk=%lld steps=%lld data=%s%s\n",
                 absl::GetFlag(FLAGS_model).c_str(), run.objective.name.c_str(), run.strategy.name.c_str(),
                 static_cast<long long>(run.report_seq_len), static_cast<long long>(run.strategy.chunk),
                 static_cast<long long>(run.steps), run.data_what.c_str(),
                 run.ref_model.empty() ? "" : absl::StrCat(" ref_model=", run.ref_model).c_str());
  if (!run.lora.empty() && run.lead) std::fprintf(stderr, "%s\n", run.lora.c_str());
}

// The report's per-step records of the steps before a resume (their timings are not known).
void AddResumedSteps(const std::map<std::string, std::vector<double>>& history, int64_t done,
                     tools::RunReport& report) {
  auto at = [&](const char* key, int64_t i) {
    const auto it = history.find(key);
    return it != history.end() && i < static_cast<int64_t>(it->second.size()) ? it->second[i] : std::nan("");
  };
  for (int64_t i = 0; i < done; ++i) {
    tools::StepRecord r;
    r.step = i + 1;
    r.loss = at("loss", i);
    r.lr = at("lr", i);
    r.grad_norm = at("grad_norm", i);
    r.tokens = std::isnan(at("tokens", i)) ? 0 : static_cast<int64_t>(at("tokens", i));
    report.AddStep(r);
  }
}

// --out_dir: refuses to overwrite a run's checkpoints; --resume continues from the newest complete one.
void ResumeFromCheckpoint(TrainRun& run) {
  if (run.out_dir.empty()) return;
  const std::vector<std::pair<int64_t, std::string>> existing = ListCheckpoints(run.out_dir);
  if (!run.resume && !existing.empty())
    tools::ExitIfError(absl::AlreadyExistsError(absl::StrCat(
                           run.out_dir, " already holds ", existing.front().second,
                           ": pass --resume to continue from its newest checkpoint, or choose another --out_dir")),
                       "--out_dir");
  if (!run.resume) return;
  std::vector<std::string> skipped;
  absl::StatusOr<std::string> latest = FindLatestCheckpoint(run.out_dir, &skipped);
  for (const std::string& why : skipped) std::fprintf(stderr, "warning: --resume: skipping %s\n", why.c_str());
  if (latest.status().code() == absl::StatusCode::kNotFound) {
    std::fprintf(stderr, "--resume: no checkpoint in %s yet: starting at step 1\n", run.out_dir.c_str());
    return;
  }
  tools::ExitIfError(latest.status(), "--resume");
  std::optional<dist::WholeTrainer> whole;  // --tp: the checkpoint holds the whole model
  if (run.grid) {
    absl::StatusOr<dist::WholeTrainer> w = dist::MakeWholeTrainer(*run.trainer, Device::kCPU);
    tools::ExitIfError(w.status(), "--resume");
    whole = std::move(*w);
  }
  absl::StatusOr<CheckpointMeta> meta =
      LoadCheckpoint(*latest, run.grid ? *whole->trainer : *run.trainer, &run.run_config);
  tools::ExitIfError(meta.status(), "--resume");
  if (run.grid) tools::ExitIfError(dist::ScatterTrainer(*whole->trainer, *run.trainer), "--resume");
  for (const std::string& w : meta->warnings) std::fprintf(stderr, "warning: --resume: %s\n", w.c_str());
  const int64_t done = meta->trainer.step;
  if (static_cast<int64_t>(meta->history["loss"].size()) != done)
    tools::ExitIfError(absl::DataLossError(absl::StrCat(*latest, ": its loss history has ",
                                                        meta->history["loss"].size(), " steps, not ", done)),
                       "--resume");
  run.train_data.next = meta->data_position;
  run.history = meta->history;
  run.first_step = done + 1;
  AddResumedSteps(run.history, done, run.monitor->report());
  std::fprintf(stderr, "resumed from %s: step %lld of %lld\n", latest->c_str(), static_cast<long long>(done),
               static_cast<long long>(run.steps));
}

// Every rank starts from rank 0's weights (of the same blocks), whatever each rank loaded.
void SyncRanks(TrainRun& run) {
  if (!run.comm) return;
  for (Param& p : run.model->params())
    tools::ExitIfError(
        WithHostBytes(p.value, /*write_back=*/true,  // the communicators take host memory
                      [&](void* d) { return run.dp_comm->Broadcast(d, p.value.numel(), p.value.dtype(), 0); }),
        run.dist_what.c_str());
  if (run.lead && run.layer_sharded)
    std::fprintf(stderr, "layer-sharded adjoint: %d ranks (%s), rank 0 owns layers [%d, %d) of %d\n", run.comm->size(),
                 run.comm->backend().c_str(), run.layer_sharded->block().begin, run.layer_sharded->block().end,
                 run.model->num_layers());
  else if (run.lead && run.dp_comm->size() > 1)
    std::fprintf(stderr, "data parallel: %d ranks (%s)%s, each takes its share of the %lld records of a step\n",
                 run.dp_comm->size(), run.comm->backend().c_str(),
                 run.shard_optimizer ? ", optimizer state sharded (ZeRO-1)" : "",
                 static_cast<long long>(run.batch * run.opt.grad_accum));
  if (run.lead && run.grid)
    std::fprintf(stderr, "tensor parallel: %d groups of %d ranks, each rank holding 1/%d of the weights and KV\n",
                 run.dp_comm->size(), run.grid->tp->size(), run.grid->tp->size());
}

// --tp: checkpoints and saves write the whole model, gathered from every group's blocks (every rank takes part).
dist::WholeTrainer GatherWhole(TrainRun& run) {
  absl::StatusOr<dist::WholeTrainer> w = dist::MakeWholeTrainer(*run.trainer, Device::kCPU);
  tools::ExitIfError(w.status(), "--tp");
  tools::ExitIfError(dist::GatherTrainer(*run.trainer, *w->trainer), "--tp");
  return std::move(*w);
}

// A checkpoint in --out_dir; noted above the progress line.
void SaveRunCheckpoint(TrainRun& run, tools::Progress& notes) {
  std::optional<dist::WholeTrainer> whole;
  if (run.grid) whole = GatherWhole(run);
  if (!run.lead) return;
  CheckpointMeta meta;
  meta.trainer = run.trainer->state();
  meta.seed = run.seed;
  meta.data_position = run.train_data.next;
  meta.history = run.history;
  meta.run_config = run.run_config;
  Trainer& saved_trainer = run.grid ? *whole->trainer : *run.trainer;
  absl::StatusOr<std::string> path = SaveCheckpoint(run.out_dir, saved_trainer, meta, static_cast<int>(run.keep));
  if (!path.ok()) {  // the steps since the last checkpoint are kept, resumable, before the run stops
    absl::StatusOr<std::string> kept = tools::KeepElsewhere(
        run.out_dir, [&](const std::string& dir) { return SaveCheckpoint(dir, saved_trainer, meta, 0).status(); });
    const std::string where =
        kept.ok() ? absl::StrCat("the checkpoint is kept in ", *kept, " (continue with --out_dir=", *kept, " --resume)")
                  : std::string(kept.status().message());
    tools::ExitIfError(absl::Status(path.status().code(), absl::StrCat(path.status().message(), "; ", where)),
                       "--out_dir");
  }
  const std::string line = absl::StrCat("saved ", *path);
  if (notes.tty())
    notes.Note(line);
  else
    std::fprintf(stderr, "%s\n", line.c_str());
}

// One optimizer step on --grad_accum micro-batches, by whichever of the layer-sharded adjoint, data parallelism or
// the trainer runs it.
absl::StatusOr<StepMetrics> RunStep(TrainRun& run, std::vector<Batch>& micro_batches) {
  absl::StatusOr<StepMetrics> m;
  if (run.layer_sharded) {  // every rank runs every sequence through its own layers
    std::vector<Sequence> all;
    for (Batch& b : micro_batches) all.insert(all.end(), b.sequences.begin(), b.sequences.end());
    m = run.layer_sharded->Step(all);
    if (m.ok()) m->micro_batches = run.opt.grad_accum;
  } else if (run.data_parallel) {  // one batch of all the micro-batches' records (what Step(micro_batches) equals)
    Batch whole;
    for (Batch& b : micro_batches) {
      whole.sequences.insert(whole.sequences.end(), b.sequences.begin(), b.sequences.end());
      whole.pairs.insert(whole.pairs.end(), b.pairs.begin(), b.pairs.end());
      whole.groups.insert(whole.groups.end(), b.groups.begin(), b.groups.end());
    }
    uint64_t first = 0;
    const Batch shard = dist::ShardOf(whole, run.dp_comm->rank(), run.dp_comm->size(), &first);
    m = run.data_parallel->Step(shard, first);
    if (m.ok()) m->micro_batches = run.opt.grad_accum;
  } else {
    m = run.trainer->Step(micro_batches);
  }
  return m;
}

// The steps from first_step to --steps (or --stop_at_step), with checkpoints in --out_dir.
void TrainSteps(TrainRun& run) {
  tools::Progress notes = tools::Progress::ForStdout();  // checkpoint notes above the progress line
  std::vector<double>& losses = run.history["loss"];
  run.last_step = run.stop_at_step > 0 ? std::min(run.steps, run.stop_at_step) : run.steps;
  run.monitor->set_last_step(run.last_step);
  for (int64_t step = run.first_step; step <= run.last_step; ++step) {
    int64_t batch_tokens = 0;
    std::vector<Batch> micro_batches;  // --grad_accum micro-batches of --batch records each
    for (int64_t i = 0; i < run.opt.grad_accum; ++i) {
      int64_t t = 0;
      micro_batches.push_back(run.train_data.Next(run.objective.name, run.batch, run.seed, &t));
      batch_tokens += t;
    }
    run.monitor->BeginStep(step);
    const int64_t tp_bytes_before = run.grid ? run.grid->tp->bytes_communicated() : 0;
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepMetrics> m = RunStep(run, micro_batches);
    const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (run.grid) run.tp_bytes_last_step = run.grid->tp->bytes_communicated() - tp_bytes_before;
    run.seconds += step_seconds;
    tools::ExitIfError(m.status(), absl::StrCat("step ", step).c_str());
    run.tokens += batch_tokens;
    losses.push_back(m->loss);
    run.history["lr"].push_back(m->lr);
    run.history["grad_norm"].push_back(m->grad_norm);
    run.history["tokens"].push_back(static_cast<double>(batch_tokens));
    run.monitor->EndStep(step, *m, m->lr, batch_tokens, step_seconds, run.tokens / run.seconds);
    if (!run.out_dir.empty() && ((run.save_every > 0 && step % run.save_every == 0) || step == run.last_step))
      SaveRunCheckpoint(run, notes);
  }
  run.monitor->FinishProgress();
  if (run.first_step > run.last_step)
    std::fprintf(stderr, "the checkpoint already has %lld steps (%s=%lld): nothing to train\n",
                 static_cast<long long>(run.first_step - 1), run.last_step < run.steps ? "--stop_at_step" : "--steps",
                 static_cast<long long>(run.last_step));
  if (losses.empty()) tools::ExitIfError(absl::FailedPreconditionError("no step was trained"), "--stop_at_step");
}

double TokensPerSecond(const TrainRun& run) { return run.seconds > 0 ? run.tokens / run.seconds : 0; }

// The run's summary on stdout: losses, throughput, peak memory per category, evaluation, communication.
void PrintSummary(TrainRun& run, const MemorySnapshot& mem) {
  const std::vector<double>& losses = run.history["loss"];
  std::printf("done: %lld steps, %s loss %.4f -> %.4f, %.0f tokens/s, peak %s\n", static_cast<long long>(losses.size()),
              run.objective.name.c_str(), losses.front(), losses.back(), TokensPerSecond(run),
              Mib(mem.total_peak).c_str());
  for (int i = 0; i < kNumMemCategories; ++i)
    std::printf("  peak %-14s %s\n", MemCategoryName(static_cast<MemCategory>(i)), Mib(mem.peak[i]).c_str());
  run.monitor->PrintEvalSummary(stdout);
  if (run.layer_sharded)
    std::printf("layer-sharded adjoint: %d ranks, %lld bytes sent by rank 0 in the last step\n", run.comm->size(),
                static_cast<long long>(run.layer_sharded->bytes_last_step()));
  else if (run.comm && run.dp_comm->size() > 1)
    std::printf("data parallel: %d ranks, %lld bytes all-reduced per rank per step\n", run.dp_comm->size(),
                static_cast<long long>(run.data_parallel->bytes_last_step()));
  if (run.grid)
    std::printf("tensor parallel: %d ranks per group, %lld bytes all-reduced per rank in the last step\n",
                run.grid->tp->size(), static_cast<long long>(run.tp_bytes_last_step));
}

// --save, and --out_dir's final model when the run finished. A save that fails now (the target changed during the
// run) keeps the model elsewhere, without the source's tokenizer files (they may be what failed), and the run exits
// 1 after its other outputs. Returns false when a save failed.
bool SaveTrainedModels(TrainRun& run) {
  const bool finished = static_cast<int64_t>(run.history["loss"].size()) >= run.steps;  // else --stop_at_step
  std::optional<dist::WholeTrainer> whole;  // --tp: what --save and --out_dir write
  if (run.grid && (!run.save_dir.empty() || (!run.out_dir.empty() && finished))) whole = GatherWhole(run);
  Model& saved = run.grid ? *whole->model : *run.model;
  bool saved_all = true;
  auto save_trained = [&](const std::string& dir, const char* flag) {
    const absl::Status s = tools::SaveTrained(saved, dir, tools::ModelSpec(), run.merge_lora, run.save_dtype);
    if (s.ok()) return;
    saved_all = false;
    const std::string base = saved.lora() && !run.merge_lora ? tools::ModelSpec() : "";
    absl::StatusOr<std::string> kept = tools::KeepElsewhere(
        dir, [&](const std::string& d) { return tools::SaveTrained(saved, d, base, run.merge_lora, run.save_dtype); });
    const std::string where = kept.ok() ? absl::StrCat("the trained model is kept in ", *kept,
                                                       " instead (without the source's tokenizer files)")
                                        : std::string(kept.status().message());
    std::fprintf(stderr, "error: %s: %s; %s\n", flag, std::string(s.message()).c_str(), where.c_str());
  };
  if (!run.save_dir.empty() && run.lead) save_trained(run.save_dir, "--save");
  if (!run.out_dir.empty() && finished && run.lead) save_trained(run.out_dir, "--out_dir");  // next to the checkpoints
  return saved_all;
}

// --report: the JSON summary with every loss, and the report's plots.
void WriteRunReport(TrainRun& run, const MemorySnapshot& mem) {
  const std::string report = absl::GetFlag(FLAGS_report);
  if (report.empty() || !run.lead) return;
  const std::vector<double>& losses = run.history["loss"];
  std::string losses_json;
  // Every digit (%.17g): a resumed run's losses compare exactly with an uninterrupted run's.
  for (size_t i = 0; i < losses.size(); ++i)
    absl::StrAppend(&losses_json, i ? ", " : "", absl::StrFormat("%.17g", losses[i]));
  const std::string json = absl::StrFormat(
      "{\"model\": \"%s\", \"objective\": \"%s\", \"strategy\": \"%s\", \"seq_len\": %d, \"chunk\": %d, "
      "\"steps\": %d, \"resumed_from_step\": %d, \"loss_first\": %.6f, \"loss_last\": %.6f, \"tokens_per_s\": %.1f, "
      "\"peak_bytes\": %d, "
      "\"peak_bytes_by_category\": %s, \"lora\": %s, \"losses\": [%s]}\n",
      absl::GetFlag(FLAGS_model), run.objective.name, run.strategy.name, run.report_seq_len, run.strategy.chunk,
      run.steps, run.first_step - 1, losses.front(), losses.back(), TokensPerSecond(run), mem.total_peak,
      tools::PeakByCategoryJson(mem), tools::LoraJson(*run.model), losses_json);
  tools::ExitIfError(run.monitor->WriteReport(tools::ResolveUserPath(report), json), "--report");
}

int Main() {
  TrainRun run;
  if (!JoinJob(run)) return 1;
  CheckFlags(run);
  LoadModels(run);
  LoadTrainData(run);
  Preflight(run);
  SetUpParallelism(run);
  BuildRunConfig(run);
  StartMonitor(run);
  ResumeFromCheckpoint(run);
  SyncRanks(run);
  TrainSteps(run);
  const MemorySnapshot mem = run.model->memory().Snapshot();  // before the saves allocate
  PrintSummary(run, mem);
  const bool saved = SaveTrainedModels(run);
  WriteRunReport(run, mem);
  return saved ? 0 : 1;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  sg::tools::InitTool(argc, argv, "Train a model on long sequences with a chosen gradient strategy.");
  return sg::tools::RunTool("train", sg::Main);
}
