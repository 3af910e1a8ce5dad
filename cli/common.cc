#include "cli/common.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/checked.h"
#include "core/data.h"
#include "core/io/file.h"
#include "core/lora.h"
#include "core/lora_io.h"
#include "core/model_io.h"
#include "core/models/family.h"
#include "core/plan.h"
#include "core/trainer.h"
#include "kernels/backend.h"

ABSL_FLAG(int32_t, threads, 0,
          "OpenMP/OpenBLAS threads; 0 = OMP_NUM_THREADS, else one per core. The tools also wait passively between "
          "parallel regions (OMP_WAIT_POLICY=PASSIVE) unless OMP_WAIT_POLICY is set");
ABSL_FLAG(std::string, model, "demo",
          "preset name (tiny, tiny-qwen2, demo, bench-cpu; real shapes, random weights: llama-3.1-8b, qwen2.5-7b, "
          "qwen2.5-32b; Mamba: tiny-ssm, bench-ssm, mamba-2.8b) or a Hugging Face model directory");
ABSL_FLAG(int64_t, max_line_bytes, sg::kDefaultMaxLineBytes,
          "longest JSONL line (one record of --data / --eval_data) read, in bytes; a longer one is refused");
ABSL_FLAG(std::string, overlong, "refuse",
          "a .jsonl record (of --data / --eval_data) longer than --seq_len + 1 tokens: refuse (an error naming its "
          "line and length), truncate (keep its first --seq_len + 1 tokens) or split (into sequences of --seq_len "
          "that together train every label); the counts are printed at the start");
ABSL_FLAG(int64_t, doc_sep_token, -1,
          "a .bin token file (of --data / --eval_data) holds documents, each ending with this token (e.g. the EOS id): "
          "positions attend within their document and no label crosses into the next; -1 = one token stream");
ABSL_FLAG(std::string, dtype, "f32",
          "f32, f64, or bf16 (CPU, Llama/Qwen2: weight matrices, KV pages and logits stored in bf16, read tile by "
          "tile into f32 compute; fp32 gradients, masters and AdamW moments)");
ABSL_FLAG(std::string, device, "cpu",
          "where the model lives and runs: cpu, or cuda (a build with --config=cuda on a machine with a GPU); meta "
          "(no storage, no compute) is for //cli:plan only");
ABSL_FLAG(std::string, matmul, "fp32",
          "how f32 matmuls multiply: fp32 (exact), bf16 (bf16 inputs, f32 accumulation; cpu and cuda), or tf32 "
          "(cuda)");
ABSL_FLAG(int64_t, attention_group, 0,
          "seco: attention visits the KV cache in groups of this many tokens (whole pages) and merges them; with "
          "--offload a group is what the device holds of a layer's earlier pages at once; 0 = 16384");
ABSL_FLAG(std::string, adjoint_window, "none",
          "adjoint: truncation window T̄ in tokens (only pairs with t - i < T̄), or none");
// The trainer options every tool takes (cabi/trainer_options.inc).
#define SG_CLI_FLAG_Tools SG_CLI_DEFINE_FLAG
#define SG_CLI_FLAG_Train SG_CLI_SKIP
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_CLI_OPTION(FLAG, name, kind, engine, cli, doc)
#include "cabi/trainer_options.inc"

ABSL_FLAG(int64_t, lora_rank, 0,
          "LoRA rank r: train low-rank adapters on --lora_targets with the base weights frozen; 0 = off (full "
          "fine-tuning)");
ABSL_FLAG(double, lora_alpha, 0, "LoRA alpha: the adapters' output is scaled by alpha / r; 0 = 2 x rank");
ABSL_FLAG(double, lora_dropout, -1,
          "LoRA dropout on the adapters' input, in [0, 1) (training passes only); default 0, or the adapter's with "
          "--lora_init");
ABSL_FLAG(std::string, lora_targets, "",
          "LoRA target modules by HF name, comma-separated, or all. Llama/Qwen2: q_proj, k_proj, v_proj, o_proj, "
          "gate_proj, up_proj, down_proj (default q_proj,v_proj); Qwen3.5 / Qwen3-Next also in_proj_qkv, in_proj_z, "
          "in_proj_b, in_proj_a / in_proj_qkvz, in_proj_ba, out_proj; MoE layers' fused expert weights by parameter "
          "name: experts.gate_up_proj, experts.down_proj (PEFT's target_parameters; docs/lora.md); Mamba: in_proj, "
          "x_proj (default both); 'all' or 'all-linear' = every module (not the expert weights)");
ABSL_FLAG(std::string, lora_init, "",
          "start LoRA from a saved PEFT adapter directory (adapter_config.json + adapter_model.safetensors)");

namespace sg::tools {

namespace {

// --help: every flag the tool defines (Abseil's own flags are under --helpfull), then exit 0.
[[noreturn]] void PrintHelp() {
  std::map<std::string, const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags())
    if (!absl::StrContains(flag->Filename(), "absl/")) flags[std::string(name)] = flag;
  std::printf("%s\n\nFlags:\n", std::string(absl::ProgramUsageMessage()).c_str());
  for (const auto& [name, flag] : flags)
    std::printf("  --%s (%s) default: %s\n", name.c_str(), flag->Help().c_str(),
                flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue().c_str());
  std::printf("\n  --help: this list; --helpfull: also the flags of the libraries (Abseil)\n");
  std::exit(0);
}

}  // namespace

void InitTool(int argc, char** argv, const char* usage) {
  // libgomp reads OMP_WAIT_POLICY once, when it loads: spin-waiting threads steal the CPU from anything else on the
  // machine (a seco step ran many times slower beside another busy process), so run again with passive waiting.
  if (!std::getenv("OMP_WAIT_POLICY") && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0)
    execv("/proc/self/exe", argv);  // returns only on failure: then go on with the default policy
  absl::SetProgramUsageMessage(usage);
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    if (a == "--help" || a == "-help" || a == "-h" || a == "--helpshort" || a == "-helpshort") PrintHelp();
  }
  absl::ParseCommandLine(argc, argv);
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 0) ExitIfError(absl::InvalidArgumentError(absl::StrCat("got ", threads, "; need >= 0")), "--threads");
  SetThreads(threads);
}

std::string ResolveUserPath(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
  return wd ? absl::StrCat(wd, "/", path) : path;
}

std::string ModelSpecOf(const std::string& m) {
  if (PresetSpec(m).ok()) return m;
  return ResolveUserPath(m);
}

std::string ModelSpec() { return ModelSpecOf(absl::GetFlag(FLAGS_model)); }

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "f32") return DType::kF32;
  if (name == "f64") return DType::kF64;
  if (name == "bf16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: '", name, "' is not supported (f32, f64, bf16)"));
}

Device DeviceFromFlags() {
  absl::StatusOr<Device> d = ParseDevice(absl::GetFlag(FLAGS_device));
  ExitIfError(d.status(), "--device");
  if (*d == Device::kMeta)
    ExitIfError(absl::InvalidArgumentError("meta tensors hold no values: --device=meta only plans memory, with "
                                           "//cli:plan"),
                "--device");
  ExitIfError(CheckDevice(*d), "--device");
  const std::string matmul = absl::GetFlag(FLAGS_matmul);
  const DeviceBackend* b = FindBackend(*d);
  std::string refused;
  if (b->set_matmul)
    refused = b->set_matmul(matmul);
  else if (matmul != "fp32")
    refused = absl::StrCat("the ", DeviceName(*d), " backend multiplies in fp32 only");
  if (!refused.empty()) ExitIfError(absl::InvalidArgumentError(refused), "--matmul");
  return *d;
}

absl::Status CheckDeviceMemory(Model& model, const StrategyOptions& s, int64_t seq_len) {
  const Device d = model.memory().device();
  const DeviceBackend* b = FindBackend(d);
  int64_t free_bytes = 0, total_bytes = 0;
  if (d == Device::kCPU) {  // the host: what this process can still take (MemAvailable, the cgroup's limit)
    free_bytes = total_bytes = HostAvailableBytes();
    if (free_bytes < 0) return absl::OkStatus();
  } else {
    if (!b || !b->memory_info) return absl::OkStatus();
    b->memory_info(&free_bytes, &total_bytes);
  }
  const MemorySnapshot now = model.memory().Snapshot();
  const int64_t margin = 256ll << 20;  // cuBLAS workspace, scratch, fragmentation
  if (seq_len > 0) {
    // The plan of a step at seq_len on a meta twin of the model (core/plan.h): its exact peak, weights included.
    absl::StatusOr<std::unique_ptr<Model>> twin = MetaTwin(model);
    if (!twin.ok()) return twin.status();
    absl::StatusOr<MemoryPlan> plan = PlanStep(**twin, s, ObjectiveOptions{}, seq_len);
    if (!plan.ok()) return plan.status();
    const MemorySnapshot& p = plan->device;
    const int64_t host = d == Device::kCPU ? plan->host_bytes : 0;  // offloaded pages share the host's memory
    std::string parts;
    for (int i = 0; i < kNumMemCategories; ++i)
      if (p.at_total_peak[i] > 0)
        absl::StrAppendFormat(&parts, "%s%s %.1f", parts.empty() ? "" : ", ",
                              MemCategoryName(static_cast<MemCategory>(i)), p.at_total_peak[i] / 1048576.0);
    // Overflow-checked (--seq_len may be absurd): an overflow is "more than any device has".
    int64_t needed = 0;
    if (!CheckedAdd(p.total_peak, host, &needed) || !CheckedAdd(needed, margin, &needed) ||
        needed > now.total_current + free_bytes)
      return absl::ResourceExhaustedError(absl::StrFormat(
          "--seq_len=%d does not fit on the %s: the plan of a --strategy=%s step peaks at %.1f MiB (%s MiB)%s + "
          "256 MiB margin, and %.1f MiB are free besides the %.1f MiB already there (%.1f MiB in all); try "
          "--strategy=seco with a smaller --chunk, or a shorter --seq_len (plan it with //cli:plan)",
          seq_len, d == Device::kCPU ? "host" : "GPU", s.name, p.total_peak / 1048576.0, parts,
          host ? absl::StrFormat(" + %.1f MiB of offloaded pages", host / 1048576.0) : "", free_bytes / 1048576.0,
          now.total_current / 1048576.0, total_bytes / 1048576.0));
    if (d != Device::kCPU && plan->host_bytes > 0) {
      const int64_t host_free = HostAvailableBytes();
      if (host_free >= 0 && plan->host_bytes > host_free)
        return absl::ResourceExhaustedError(absl::StrFormat(
            "--seq_len=%d does not fit on the host: --offload keeps %.1f MiB of KV and KV-gradient pages there and "
            "%.1f MiB are available; try --sparse_pages or a shorter --seq_len",
            seq_len, plan->host_bytes / 1048576.0, host_free / 1048576.0));
    }
  }
  // Past the GPU's free memory managed allocations would page silently; fail clearly instead.
  if (model.memory().limit() == 0 || model.memory().limit() > now.total_current + free_bytes - margin)
    model.memory().set_limit(now.total_current + free_bytes - margin);
  return absl::OkStatus();
}

// The flags every tool has that the list gives the engine struct Engine as they are.
template <typename Engine>
void CopyToolFlags(Engine* to){
#define SG_CLI_COPY_Tools SG_CLI_COPY_FLAG
#define SG_CLI_COPY_Train SG_CLI_SKIP
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_CLI_OPTION(COPY, name, kind, engine, cli, doc)
#include "cabi/trainer_options.inc"
}

StrategyOptions StrategyFromFlags() {
  StrategyOptions o;
  o.name = absl::GetFlag(FLAGS_strategy);
  CopyToolFlags(&o);
  o.attention_group = absl::GetFlag(FLAGS_attention_group);
  absl::StatusOr<int64_t> window = ParseAdjointWindow(absl::GetFlag(FLAGS_adjoint_window));
  ExitIfError(window.status(), "flags");
  o.adjoint_window = *window;
  return o;
}

absl::StatusOr<int64_t> ParseAdjointWindow(const std::string& text) {
  if (text == "none") return StrategyOptions::kNoAdjointWindow;
  int64_t w = 0;
  if (!absl::SimpleAtoi(text, &w) || w <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--adjoint_window must be a positive number of tokens or 'none', got '", text, "'"));
  return w;
}

ObjectiveOptions ObjectiveFromFlags() {
  ObjectiveOptions o;
  o.name = absl::GetFlag(FLAGS_objective);
  CopyToolFlags(&o);
  o.grpo_kl_bias_correction = absl::GetFlag(FLAGS_grpo_kl_bias_correction);
  return o;
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
    if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(absl::StrCat(path, ": cannot rename"));
  return absl::OkStatus();
}

std::string PeakByCategoryJson(const MemorySnapshot& s) {
  std::string out = "{";
  for (int i = 0; i < kNumMemCategories; ++i)
    absl::StrAppend(&out, i ? ", " : "", "\"", MemCategoryName(static_cast<MemCategory>(i)), "\": ", s.peak[i]);
  return out + "}";
}

bool LoraRequested() { return absl::GetFlag(FLAGS_lora_rank) != 0 || !absl::GetFlag(FLAGS_lora_init).empty(); }

std::string ApplyLoraFlags(Model& model) {
  const int64_t rank = absl::GetFlag(FLAGS_lora_rank);
  const double alpha = absl::GetFlag(FLAGS_lora_alpha), dropout = absl::GetFlag(FLAGS_lora_dropout);
  const std::string targets = absl::GetFlag(FLAGS_lora_targets), init = ResolveUserPath(absl::GetFlag(FLAGS_lora_init));
  if (rank == 0 && init.empty()) {
    if (alpha != 0 || dropout != -1 || !targets.empty())
      ExitIfError(absl::InvalidArgumentError("--lora_alpha, --lora_dropout and --lora_targets need --lora_rank "
                                             "(or --lora_init)"),
                  "flags");
    return "";
  }
  LoraOptions o;
  o.seed = absl::GetFlag(FLAGS_seed);
  if (!init.empty()) {
    absl::StatusOr<LoraOptions> file = ReadLoraAdapterConfig(init, LoraKind::Of(model));
    ExitIfError(file.status(), "--lora_init");
    std::vector<std::string> differ;
    if (rank != 0 && rank != file->rank) differ.push_back(absl::StrCat("--lora_rank=", rank, " vs r ", file->rank));
    if (alpha != 0 && alpha != file->alpha)
      differ.push_back(absl::StrCat("--lora_alpha=", alpha, " vs lora_alpha ", file->alpha));
    if (!targets.empty()) {
      absl::StatusOr<std::vector<std::string>> t = ParseLoraTargets(targets, LoraKind::Of(model));
      ExitIfError(t.status(), "flags");
      if (*t != file->targets) differ.push_back(absl::StrCat("--lora_targets=", targets, " vs target_modules"));
    }
    if (!differ.empty())
      ExitIfError(absl::InvalidArgumentError(absl::StrCat("the adapter in ", init, " differs from the flags (",
                                                          absl::StrJoin(differ, "; "),
                                                          "): leave those flags out to take the adapter's")),
                  "--lora_init");
    o.rank = file->rank;
    o.alpha = file->alpha;
    o.targets = file->targets;
    o.dropout = dropout >= 0 ? dropout : file->dropout;
  } else {
    o.rank = rank;
    o.alpha = alpha != 0 ? alpha : 2.0 * rank;
    o.dropout = dropout == -1 ? 0.0 : dropout;
    const LoraKind kind = LoraKind::Of(model);
    absl::StatusOr<std::vector<std::string>> t =
        ParseLoraTargets(targets.empty() ? DefaultLoraTargets(kind) : targets, kind);
    ExitIfError(t.status(), "flags");
    o.targets = *t;
  }
  ExitIfError(EnableLora(model, o), "flags");
  if (!init.empty()) ExitIfError(LoadLoraAdapter(model, init), "--lora_init");
  int64_t trainable = 0, total = 0;
  for (const Param& p : model.params()) {
    total += p.value.numel();
    if (p.grad.defined()) trainable += p.value.numel();
  }
  const int64_t frozen = total - trainable;
  return absl::StrFormat(
      "LoRA r=%d alpha=%g dropout=%g on %s (%d modules%s): %d trainable parameters, %.2f%% of the "
      "%d frozen base parameters",
      o.rank, o.alpha, o.dropout, absl::StrJoin(o.targets, ","), model.lora()->adapters.size(),
      init.empty() ? "" : absl::StrCat(", from ", init), trainable, 100.0 * trainable / std::max<int64_t>(1, frozen),
      frozen);
}

std::string LoraJson(Model& model) {
  const LoraInfo* lora = model.lora();
  if (!lora) return "null";
  int64_t trainable = 0;
  for (const Param& p : model.params())
    if (p.grad.defined()) trainable += p.value.numel();
  return absl::StrFormat(
      "{\"rank\": %d, \"alpha\": %g, \"dropout\": %g, \"targets\": [\"%s\"], \"adapters\": %d, "
      "\"trainable_params\": %d}",
      lora->options.rank, lora->options.alpha, lora->options.dropout, absl::StrJoin(lora->options.targets, "\", \""),
      lora->adapters.size(), trainable);
}

absl::Status SaveTrained(Model& model, const std::string& dir, const std::string& base, bool merge,
                         std::optional<DType> save_dtype) {
  if (model.lora() && !merge) return SaveLoraAdapter(model, dir, base);
  return SaveModel(model, dir, base, save_dtype);
}

absl::Status CheckSaveTrained(Model& model, const std::string& dir, const std::string& base, bool merge) {
  if (model.lora() && !merge) return CheckWritableTarget(dir);
  return CheckModelSave(dir, base);
}

absl::StatusOr<std::string> KeepElsewhere(const std::string& target,
                                          const std::function<absl::Status(const std::string& dir)>& write) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tried;
  absl::Status last;
  for (const std::string& place : {io::ParentOf(target), std::string(tmp && *tmp ? tmp : "/tmp")}) {
    std::string dir = place + "/seqgrad-kept-XXXXXX";
    if (!mkdtemp(dir.data())) {
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", place, ": ", std::strerror(errno));
      continue;
    }
    last = write(dir);
    if (last.ok()) return dir;
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", last.message());
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return absl::Status(last.ok() ? absl::StatusCode::kInternal : last.code(),
                      absl::StrCat("could not keep it elsewhere either (", tried, ")"));
}

void ExitIfError(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "error: %s: %s\n", what, std::string(s.message()).c_str());
  std::exit(1);
}

int RunTool(const char* tool, int (*body)()) {
  try {
    return body();
  } catch (...) {
    const absl::Status s = StatusOfCurrentException(tool);
    std::fprintf(stderr, "error: %s (%s)\n", std::string(s.message()).c_str(),
                 absl::StatusCodeToString(s.code()).c_str());
    return 1;
  }
}

}  // namespace sg::tools
