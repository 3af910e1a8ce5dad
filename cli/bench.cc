// Benchmark: time and memory of one gradient computation (forward + backward of a strategy, no optimizer step)
// per (strategy, sequence length), with the engine's own memory accounting, the machine's sgemm rate as the
// yardstick, optionally the same model in plain PyTorch (cli/bench_torch.py) and a memory-budget search.
//
//   ./bazelw run //cli:bench -- --model=bench-cpu --strategies=full,ckpt --seq_lens=1024,2048,4096
//       --compare_torch --json=/tmp/bench.json
//
// adjoint (SSMs) takes variants in --strategies: "adjoint" (pairs, no window), "adjoint:256" (pairs, window 256),
// "adjoint:scan" (the reverse-scan form), "adjoint:paper".
//
// "forward" in --strategies times the loss alone (chunked forward, no gradients): the floor that spaco's time
// approaches. spaco samples different chunks on every run, so its time is the mean over the timed runs, not the
// best; every other row reports the best run. Runs of the strategies are interleaved, round by round.
//
// Writes a table to stdout, {"rows": [...], "sgemm_gflops": x, "config": {...}, ...} to --json and a chart
// (peak memory and time vs T) to the same path with .svg.
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/host_cache.h"
#include "base/memory.h"
#include "cli/census.h"
#include "cli/common.h"
#include "cli/svg_chart.h"
#include "core/data.h"
#include "core/model_io.h"
#include "core/models/family.h"
#include "core/models/footprint.h"
#include "core/trainer.h"
#include "distributed/mpi_plugin.h"
#include "distributed/tensor_parallel.h"
#include "kernels/backend.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(
    std::string, strategies, "full,ckpt",
    "comma-separated strategies to benchmark (also forward, spaco, adjoint:scan|pairs|paper|<window>, seco:offload); "
    "<strategy>:docs runs the same tokens as packed documents of --doc_len tokens, attending within each");
ABSL_FLAG(int64_t, doc_len, 1024,
          "tokens per document of the :docs strategies (and of PyTorch's full:docs / ckpt:docs, which run the "
          "documents one by one)");
ABSL_FLAG(double, skip_after_s, 0,
          "skip the longer sequences of a strategy once one of its runs took longer than this (seconds; 0 = never): "
          "for adjoint's quadratic pair form");
ABSL_FLAG(std::string, seq_lens, "1024,2048,4096", "comma-separated sequence lengths (tokens)");
ABSL_FLAG(int32_t, repeats, 3, "timed rounds per length (each runs every strategy once); the best is reported");
ABSL_FLAG(int32_t, warmup, 1, "untimed rounds before the timed ones");
ABSL_FLAG(std::string, json, "", "write the results here as JSON, and a chart next to it (.svg)");
ABSL_FLAG(bool, compare_torch, false,
          "also time the same model in PyTorch (cli/bench_torch.py: plain torch ops, and Hugging Face "
          "transformers' model class with SDPA where --python has transformers; the Qwen3.5 / Qwen3-Next hybrids, "
          "mixtures of experts and Mamba-2 in transformers only)");
ABSL_FLAG(std::string, torch_strategies, "",
          "--compare_torch: the PyTorch strategies (full, ckpt); default: those of --strategies");
ABSL_FLAG(int64_t, memory_budget, 0,
          "bytes: for each strategy, search the longest sequence whose measured peak fits (0 = no search)");
ABSL_FLAG(std::string, task, "random",
          "synthetic sequence: random (random tokens, every next-token label counts) or retrieval "
          "(sg::RetrievalTask: only the query values are labelled, so the LM head does little work)");
ABSL_FLAG(double, spaco_fraction, 0.125,
          "spaco: budget as a fraction t/k of each length's k chunks (rounded, at least 1); 0 = use --spaco_budget");
ABSL_FLAG(std::string, python, "/usr/bin/python3",
          "interpreter for --compare_torch (must have torch; with transformers too for the hf rows), e.g. the venv "
          "of tests/e2e/pip_venv.sh");
ABSL_FLAG(std::string, torch_script, "", "path of bench_torch.py (default: found in the runfiles)");
// --census (cli/census.h): count, do not run.
ABSL_FLAG(int32_t, tp, 1,
          "tensor parallel: run under `mpirun -np N` with --tp=N; per strategy and length, the step time of the model "
          "split over the N ranks against rank 0 alone running the whole model with N times its threads (the same "
          "cores), and the bytes each rank all-reduces per step (docs/distributed.md)");
ABSL_FLAG(std::string, config_overrides, "",
          "a JSON object merged into the --model preset's config.json (a JSON merge patch: null drops a field); the "
          "weights are random from --seed. A variant of a preset without a preset of its own, e.g. one Gated "
          "DeltaNet layer: --model=bench-cpu-qwen3.5 --config_overrides='{\"num_hidden_layers\": 1, "
          "\"layer_types\": [\"linear_attention\"], \"vocab_size\": 32}'");
ABSL_FLAG(bool, census, false,
          "print the roofline census of one training step per strategy and length instead of timing (counted on "
          "the meta device: FLOPs, bytes and time at H100 limits per kernel family, the MFU upper bound)");

namespace sg {
namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

constexpr int64_t kBudgetCap = 65536;
constexpr int64_t kBudgetQuantum = 256;

double Mib(double bytes) { return bytes / 1048576.0; }

[[noreturn]] void Fail(const std::string& what, const std::string& msg) {
  std::fprintf(stderr, "error: %s: %s\n", what.c_str(), msg.c_str());
  std::exit(1);
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipWhitespace())) {
    std::string t(absl::StripAsciiWhitespace(p));
    if (!t.empty()) out.push_back(t);
  }
  return out;
}

// --- the machine's yardstick ------------------------------------------------------------------------------------

// The machine's f32 GEMM rate: best-of-10 1024 x 1024 x 1024 with all OpenMP threads, in GFLOP/s, of OpenBLAS's
// cblas_sgemm and of the engine's own f32 GEMM (oneDNN); the yardstick is the faster of the two.
struct SgemmRates {
  double openblas = 0;
  double engine = 0;
  double best() const { return std::max(openblas, engine); }
};

SgemmRates MeasureSgemmGflops() {
  constexpr int n = 1024;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  auto rate = [&](const std::function<void()>& gemm) {
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < 11; ++rep) {  // the first is a warm-up
      const auto t0 = std::chrono::steady_clock::now();
      gemm();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best = std::min(best, dt);
    }
    return 2.0 * n * n * n / best / 1e9;
  };
  SgemmRates r;
  r.openblas = rate([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  });
  const OpTable<float>& ops = CpuOps<float>();
  r.engine = rate([&] { ops.gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n); });
  return r;
}

// User + system CPU time of the process so far (all threads), in seconds.
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// --- peak RSS, the OS's view (comparable between engines) -------------------------------------------------------

int64_t StatusKib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(f, line)) {
    if (!absl::StartsWith(line, prefix)) continue;
    int64_t kib = 0;
    std::string rest(absl::StripAsciiWhitespace(line.substr(prefix.size())));
    if (absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &kib)) return kib;
  }
  return -1;
}

// Resets the process's peak RSS (VmHWM) to its current RSS; returns the current RSS in bytes, or -1.
int64_t ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.close();
  if (!f) return -1;
  const int64_t kib = StatusKib("VmRSS");
  return kib < 0 ? -1 : kib * 1024;
}

int64_t PeakRss() {
  const int64_t kib = StatusKib("VmHWM");
  return kib < 0 ? -1 : kib * 1024;
}

// --- model arithmetic -------------------------------------------------------------------------------------------

// The model as the bench reports it: a one-line description, its config as JSON, and the useful FLOPs of one
// gradient computation over T tokens (head_tokens with a label), the same for every strategy (recomputation is
// not useful work): 6 x matmul params x tokens (the LM head's only for labelled tokens), plus the family's token
// mixing (attention, scan; ModelSpec::MixingForwardFlops) x3 for forward + backward.
struct ModelFacts {
  std::string description;
  json config;
  std::function<double(int64_t T, int64_t head_tokens)> useful_flops;
};

ModelFacts Describe(Model& model) {
  const std::shared_ptr<const ModelSpec> spec = model.spec();
  ModelFacts f;
  f.description = spec->Description();
  for (const auto& [key, value] : spec->Fields())
    std::visit([&, key = key](const auto& v) { f.config[key] = v; }, value);
  f.config["matmul_params"] = spec->MatmulParams();
  const double matmul = static_cast<double>(spec->MatmulParams());
  const double head = static_cast<double>(model.vocab_size()) * static_cast<double>(model.hidden_size());
  f.useful_flops = [spec, matmul, head](int64_t T, int64_t head_tokens) {
    return 6.0 * (matmul - head) * T + 6.0 * head * head_tokens + 3.0 * spec->MixingForwardFlops(T);
  };
  return f;
}

// --model, with --config_overrides merged into its preset's config.json (random weights from the seed), refused
// before anything is allocated when the patch is no JSON object, the result no valid config or too large for the
// host.
// offload_experts: a mixture of experts' expert weights made in host memory (--offload_experts).
absl::StatusOr<std::unique_ptr<Model>> LoadBenchModel(DType dtype, uint64_t seed, Device device, bool offload_experts) {
  const std::string overrides = absl::GetFlag(FLAGS_config_overrides);
  if (overrides.empty())
    return LoadAnyModel(tools::ModelSpec(), dtype, seed, device, tools::LoraRequested(), offload_experts);
  const std::string name = absl::GetFlag(FLAGS_model);
  absl::StatusOr<std::unique_ptr<ModelSpec>> preset = PresetSpec(name);
  if (!preset.ok())
    return absl::InvalidArgumentError(absl::StrCat("varies a preset (random weights); --model=", name, " is not one"));
  const json patch = json::parse(overrides, nullptr, /*allow_exceptions=*/false);
  if (patch.is_discarded() || !patch.is_object())
    return absl::InvalidArgumentError(absl::StrCat("must be a JSON object, got '", overrides, "'"));
  json config = json::parse((*preset)->HFConfigJson());
  config.merge_patch(patch);
  const std::string source = absl::StrCat(name, "'s config.json merged with them");
  absl::StatusOr<std::unique_ptr<ModelSpec>> spec = ParseConfigSpec(config.dump(), source);
  if (!spec.ok()) return spec.status();
  absl::StatusOr<ModelFootprint> footprint = (*spec)->Footprint(dtype);
  if (!footprint.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", footprint.status().message()));
  if (device == Device::kCPU)
    if (absl::Status s = CheckFootprintFits(*footprint, HostAvailableBytes(), source); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<Model>> model =
      (*spec)->Create(dtype, device, {}, tools::LoraRequested(), offload_experts);
  if (!model.ok()) return model.status();
  (*spec)->InitRandom(**model, seed);
  return model;
}

// --- sequences --------------------------------------------------------------------------------------------------

Sequence MakeSequence(const std::string& task, int64_t T, int64_t vocab, uint64_t seed) {
  if (task == "retrieval") {
    RetrievalTask t;
    t.seq_len = T;
    t.vocab = vocab;
    if (absl::Status s = t.Validate(); !s.ok()) Fail("--task=retrieval", std::string(s.message()));
    return t.Make(seed, 0);
  }
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(T));
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> all(T + 1);
  for (int32_t& t : all) t = tok(rng);
  Sequence s;
  s.ids.assign(all.begin(), all.end() - 1);
  s.labels.assign(all.begin() + 1, all.end());
  s.last_token = all.back();
  return s;
}

int64_t ValidLabels(const Sequence& s) {
  return std::count_if(s.labels.begin(), s.labels.end(), [](int32_t l) { return l >= 0; });
}

// --- seqgrad measurements ---------------------------------------------------------------------------------------

constexpr char kForwardOnly[] = "forward";

struct Measurement {
  double best_s = std::numeric_limits<double>::infinity();
  double mean_s = 0;
  // The least CPU time (user + system, all threads) over the runs: on a shared machine it moves less than wall
  // time when other jobs take the cores.
  double best_cpu_s = std::numeric_limits<double>::infinity();
  double loss = 0;
  double chunks = 0;                 // mean over timed runs
  double chunks_backpropagated = 0;  // mean over timed runs
  int64_t adjoint_pairs = 0;         // adjoint: (t, i) pairs per channel over all layers
  int64_t offloaded_bytes = 0;       // --offload: host memory holding the KV and KV-gradient pages
  MemorySnapshot mem;                // of the first timed run (the schedule is deterministic)
  int64_t rss_delta = -1;            // max over timed runs; -1 = unavailable
};

// Times trainer.ComputeGradients, or with forward_only trainer.EvaluateLoss.
absl::StatusOr<Measurement> Measure(Model& model, const StrategyOptions& so, bool forward_only, const Sequence& seq,
                                    int warmup, int repeats, bool rss) {
  Trainer trainer(model, so, OptimizerOptions{});
  const std::vector<Sequence> batch{seq};
  auto run = [&] { return forward_only ? trainer.EvaluateLoss(batch) : trainer.ComputeGradients(batch); };
  for (int i = 0; i < warmup; ++i) {
    absl::StatusOr<StepMetrics> m = run();
    if (!m.ok()) return m.status();
  }
  Measurement r;
  const int runs = std::max(1, repeats);
  for (int i = 0; i < runs; ++i) {
    // Blocks the step takes from the host cache are resident before it starts: the RSS growth misses them.
    ResetHostCacheWindow();
    const int64_t cached = GetHostCacheStats().cached_bytes;
    const int64_t base = rss ? ResetPeakRss() : -1;
    model.memory().ResetPeak();
    const double cpu0 = ProcessCpuSeconds();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepMetrics> m = run();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = ProcessCpuSeconds() - cpu0;
    const MemorySnapshot snap = model.memory().Snapshot();
    const int64_t top = rss ? PeakRss() : -1;
    if (!m.ok()) return m.status();
    if (i == 0) r.mem = snap;
    r.best_s = std::min(r.best_s, dt);
    r.best_cpu_s = std::min(r.best_cpu_s, cpu);
    r.mean_s += dt / runs;
    r.loss = m->loss;
    r.chunks += static_cast<double>(m->chunks) / runs;
    r.chunks_backpropagated += static_cast<double>(m->chunks_backpropagated) / runs;
    r.adjoint_pairs = m->adjoint_pairs;
    r.offloaded_bytes = m->offloaded_bytes;
    const int64_t reused = cached - GetHostCacheStats().window_low_cached_bytes;
    if (base >= 0 && top >= 0) r.rss_delta = std::max(r.rss_delta, top - base + reused);
  }
  return r;
}

int64_t Cat(const std::array<int64_t, kNumMemCategories>& a, MemCategory c) { return a[static_cast<int>(c)]; }

json SeqgradRow(const std::string& strategy, int64_t T, const Measurement& m, double flops, double sgemm,
                int64_t state_bytes_per_token) {
  using C = MemCategory;
  const MemorySnapshot& s = m.mem;
  const bool sampled = strategy == "spaco";
  const double secs = sampled ? m.mean_s : m.best_s;
  json row;
  row["engine"] = "seqgrad";
  row["strategy"] = strategy;
  row["seq_len"] = T;
  row["time_s"] = secs;
  row["time_stat"] = sampled ? "mean" : "best";
  row["best_time_s"] = m.best_s;
  row["mean_time_s"] = m.mean_s;
  row["cpu_s"] = m.best_cpu_s;
  row["tokens_per_s"] = T / secs;
  row["chunks"] = m.chunks;
  row["chunks_backpropagated"] = m.chunks_backpropagated;
  row["offloaded_bytes"] = m.offloaded_bytes;
  row["loss"] = m.loss;
  row["peak_bytes"] = s.total_peak;
  // Activations, workspace and logits at the moment the total peaked, and the (larger or equal) sum of their
  // own peaks, which need not coincide in time.
  row["activation_peak_bytes"] =
      Cat(s.at_total_peak, C::kActivations) + Cat(s.at_total_peak, C::kWorkspace) + Cat(s.at_total_peak, C::kLogits);
  row["activation_peak_bytes_upper"] =
      Cat(s.peak, C::kActivations) + Cat(s.peak, C::kWorkspace) + Cat(s.peak, C::kLogits);
  row["kv_bytes"] = Cat(s.peak, C::kKVCache) + Cat(s.peak, C::kKVGrad);
  row["kv_cache_bytes"] = Cat(s.peak, C::kKVCache);
  row["kv_grad_bytes"] = Cat(s.peak, C::kKVGrad);
  row["state_bytes_per_token"] = state_bytes_per_token;  // K + V of one token, all layers
  // Everything the step allocated above the resting state (weights + grads, what remains after it): comparable
  // with the torch rows' step_peak_bytes from torch's own allocator.
  row["step_peak_bytes"] = s.total_peak - s.total_current;
  row["resting_bytes"] = s.total_current;
  json by_cat = json::object(), at_peak = json::object();
  for (int i = 0; i < kNumMemCategories; ++i) {
    by_cat[MemCategoryName(static_cast<MemCategory>(i))] = s.peak[i];
    at_peak[MemCategoryName(static_cast<MemCategory>(i))] = s.at_total_peak[i];
  }
  row["peak_bytes_by_category"] = by_cat;
  row["at_total_peak_by_category"] = at_peak;
  row["rss_delta_bytes"] = m.rss_delta >= 0 ? json(m.rss_delta) : json(nullptr);
  row["gflops"] = flops / 1e9;
  row["gflops_per_s"] = flops / 1e9 / secs;
  row["sgemm_fraction"] = flops / 1e9 / secs / sgemm;
  return row;
}

// <strategy>:docs: the strategy on the sequence as packed documents (--doc_len).
constexpr absl::string_view kDocsSuffix = ":docs";
bool OnDocuments(const std::string& name) { return absl::EndsWith(name, kDocsSuffix); }

// The options of one (strategy, T) cell: forward runs chunked like seco; spaco's budget follows --spaco_fraction;
// adjoint:<form or window> picks adjoint's variant.
StrategyOptions OptionsFor(StrategyOptions so, std::string name, int64_t T, double spaco_fraction) {
  if (OnDocuments(name)) name.resize(name.size() - kDocsSuffix.size());
  so.name = name == kForwardOnly ? "seco" : name;
  // seco:offload is seco with --offload (the flag itself applies to the seco rows only).
  so.offload = (so.offload && name == "seco") || name == "seco:offload";
  if (name == "seco:offload") so.name = "seco";
  if (absl::StartsWith(name, "adjoint:")) {
    so.name = "adjoint";
    const std::string variant = name.substr(8);
    if (variant == "pairs" || variant == "scan" || variant == "paper") {
      so.adjoint_form = variant;
    } else {
      absl::StatusOr<int64_t> window = tools::ParseAdjointWindow(variant);
      tools::ExitIfError(window.status(), absl::StrCat("--strategies (", name, ")").c_str());
      so.adjoint_window = *window;
    }
  }
  if (name == "spaco" && spaco_fraction > 0) {
    const int64_t k = (T + so.chunk - 1) / so.chunk;
    so.spaco_budget = std::clamp<int64_t>(std::llround(spaco_fraction * static_cast<double>(k)), 1, k);
  }
  return so;
}

// s as packed documents of doc_len tokens.
Sequence AsDocuments(Sequence s, int64_t doc_len) {
  tools::ExitIfError(SetDocumentsOfLength(s, doc_len, "--doc_len"), "--doc_len");
  return s;
}

// What bench_torch.py runs: full or ckpt, on the sequence or (:docs) on its documents one by one.
bool IsTorchStrategy(const std::string& s) {
  return s == "full" || s == "ckpt" || s == "full:docs" || s == "ckpt:docs";
}

// The PyTorch strategy a seqgrad strategy is compared with: the same one, or for the exact chunked strategies (whose
// gradient is full backprop's) PyTorch's full on the same tokens; "" for none (forward runs as seco but computes
// no gradient).
std::string TorchCounterpart(const std::string& name, const StrategyOptions& so) {
  if (IsTorchStrategy(name)) return name;
  const bool exact = name != kForwardOnly && ((so.name == "seco" && so.sparse_pages == 0) || so.name == "streambp");
  if (!exact) return "";
  return OnDocuments(name) ? "full:docs" : "full";
}

// --- memory budget search ---------------------------------------------------------------------------------------

// The longest T (doubling from t0 up to kBudgetCap, then bisection to within 1/16 of T, on multiples of
// kBudgetQuantum) that runs under the engine's memory limit set to the budget: a probe that would pass it fails at
// the allocation instead of running to the end. 0 when not even the smallest probe fits.
json BudgetSearch(Model& model, const StrategyOptions& base, const std::string& name, double spaco_fraction, int64_t t0,
                  int64_t budget, const std::string& task, uint64_t seed) {
  json probes = json::array();
  auto fits = [&](int64_t T) {
    const StrategyOptions so = OptionsFor(base, name, T, spaco_fraction);
    Sequence seq = MakeSequence(task, T, model.vocab_size(), seed);
    if (OnDocuments(name)) seq = AsDocuments(std::move(seq), absl::GetFlag(FLAGS_doc_len));
    model.memory().set_limit(budget);
    absl::StatusOr<Measurement> m =
        Measure(model, so, name == kForwardOnly, seq, /*warmup=*/0, /*repeats=*/1, /*rss=*/false);
    model.memory().set_limit(0);
    json p;
    p["seq_len"] = T;
    if (!m.ok()) {  // e.g. out of memory: does not fit
      p["error"] = std::string(m.status().message());
      probes.push_back(p);
      std::fprintf(stderr, "  budget %s T=%lld: %s\n", name.c_str(), static_cast<long long>(T),
                   std::string(m.status().message()).c_str());
      return false;
    }
    p["peak_bytes"] = m->mem.total_peak;
    probes.push_back(p);
    const bool ok = m->mem.total_peak <= budget;
    std::fprintf(stderr, "  budget %s T=%lld: peak %.1f MiB %s\n", name.c_str(), static_cast<long long>(T),
                 Mib(m->mem.total_peak), ok ? "fits" : "over");
    return ok;
  };
  int64_t lo = 0, hi = -1;  // lo fits (0: nothing needed), hi does not (-1: unknown)
  if (const int64_t resting = model.memory().Snapshot().total_current; resting >= budget) {
    json row;
    row["strategy"] = name;
    row["max_seq_len_in_budget"] = 0;
    row["budget_bytes"] = budget;
    row["error"] = absl::StrCat("the budget is below the model's resting memory (weights, gradients) of ", resting,
                                " bytes: no sequence fits");
    return row;
  }
  for (int64_t T = std::min(t0, kBudgetCap);;) {
    if (!fits(T)) {
      hi = T;
      break;
    }
    lo = T;
    if (T >= kBudgetCap) break;
    T = std::min(2 * T, kBudgetCap);
  }
  while (hi > 0) {
    int64_t mid = (lo + hi) / 2 / kBudgetQuantum * kBudgetQuantum;
    if (mid <= lo) mid = (lo / kBudgetQuantum + 1) * kBudgetQuantum;
    if (mid >= hi || hi - lo <= std::max(kBudgetQuantum, lo / 16)) break;
    if (fits(mid))
      lo = mid;
    else
      hi = mid;
  }
  json row;
  row["strategy"] = name;
  row["max_seq_len_in_budget"] = lo;
  row["budget_bytes"] = budget;
  row["probes"] = probes;
  return row;
}

// --- the PyTorch reference --------------------------------------------------------------------------------------

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// bench_torch.py (CPU: plain torch ops) or bench_torch_gpu.py (GPU: HF transformers with SDPA).
std::string FindTorchScript(const std::string& name) {
  if (std::string f = absl::GetFlag(FLAGS_torch_script); !f.empty()) return tools::ResolveUserPath(f);
  const std::string rel = "seqgrad/cli/" + name;
  std::vector<std::string> candidates;
  for (const char* env : {"RUNFILES_DIR", "TEST_SRCDIR"})
    if (const char* d = std::getenv(env); d && *d) candidates.push_back(absl::StrCat(d, "/", rel));
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.string() + ".runfiles/" + rel);
  candidates.push_back("cli/" + name);  // bazel run's working directory is the runfiles root
  for (const std::string& c : candidates)
    if (fs::exists(c, ec)) return c;
  Fail("--compare_torch",
       absl::StrCat("cannot find ", name, " (tried ", absl::StrJoin(candidates, ", "), "); pass --torch_script"));
}

std::string TempRoot() {
  for (const char* env : {"TEST_TMPDIR", "TMPDIR"})
    if (const char* d = std::getenv(env); d && *d) return d;
  return "/tmp";
}

// Runs the PyTorch reference on the same model and sequences (bench_torch.py on the CPU, bench_torch_gpu.py on a
// GPU); returns its JSON (rows with engine "torch", or "hf" for transformers' model class, each with a "label").
// A failure of the PyTorch side is an error status: seqgrad's rows are still reported.
absl::StatusOr<json> RunTorch(Model& model, const std::vector<std::string>& strategies,
                              const std::map<int64_t, Sequence>& seqs, int warmup, int repeats,
                              const std::string& dtype, bool gpu) {
  std::string tmpl = TempRoot() + "/seqgrad_bench_XXXXXX";
  if (!mkdtemp(tmpl.data())) Fail("--compare_torch", absl::StrCat("cannot create a directory like ", tmpl));
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};

  tools::ExitIfError(SaveModel(model, dir), "--compare_torch: saving the model");
  std::vector<std::string> lens;
  for (const auto& [T, seq] : seqs) {
    std::ofstream out(absl::StrCat(dir, "/seq_", T, ".i32"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(seq.ids.data()), static_cast<std::streamsize>(T * sizeof(int32_t)));
    out.write(reinterpret_cast<const char*>(seq.labels.data()), static_cast<std::streamsize>(T * sizeof(int32_t)));
    if (!out) Fail("--compare_torch", "cannot write the token file");
    lens.push_back(absl::StrCat(T));
  }
  const std::string script = gpu ? "bench_torch_gpu.py" : "bench_torch.py";
  const std::string cmd =
      absl::StrCat(ShellQuote(absl::GetFlag(FLAGS_python)), " ", ShellQuote(FindTorchScript(script)),
                   " --model_dir=", ShellQuote(dir), " --seq_dir=", ShellQuote(dir),
                   " --strategies=", absl::StrJoin(strategies, ","), " --seq_lens=", absl::StrJoin(lens, ","),
                   " --repeats=", repeats, " --warmup=", warmup,
                   gpu ? absl::StrCat(" --matmul=", absl::GetFlag(FLAGS_matmul))  // no :docs rows on the GPU
                       : absl::StrCat(" --threads=", omp_get_max_threads(), " --dtype=", dtype,
                                      " --doc_len=", absl::GetFlag(FLAGS_doc_len)));
  std::fprintf(stderr, "running: %s\n", cmd.c_str());
  std::fflush(stderr);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) Fail("--compare_torch", "popen failed");
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) return absl::InternalError(absl::StrCat(script, " failed (status ", rc, ")"));
  // The JSON is the last non-empty line.
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipWhitespace());
  if (lines.empty()) return absl::InternalError(absl::StrCat(script, " printed nothing"));
  json j = json::parse(lines.back(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("rows") || !j["rows"].is_array())
    return absl::InternalError(absl::StrCat(script, " output is not the expected JSON: ", lines.back()));
  return j;
}

// --- output -----------------------------------------------------------------------------------------------------

std::string Cell(const json& row, const char* key, const char* fmt, double scale = 1.0) {
  if (!row.contains(key) || !row[key].is_number()) return "-";
  char b[64];
  std::snprintf(b, sizeof b, fmt, row[key].get<double>() * scale);
  return b;
}

void PrintTable(const json& rows) {
  std::printf("%-8s %-12s %7s %9s %8s %10s %8s %7s %9s %8s %8s %9s %9s\n", "engine", "strategy", "T", "time_s", "cpu_s",
              "tok/s", "GFLOP/s", "%sgemm", "peak MiB", "act MiB", "kv MiB", "step MiB", "loss");
  for (const json& r : rows) {
    const double mib = 1.0 / 1048576.0;
    std::printf("%-8s %-12s %7lld %9s %8s %10s %8s %7s %9s %8s %8s %9s %9s\n", r["engine"].get<std::string>().c_str(),
                r["strategy"].get<std::string>().c_str(), static_cast<long long>(r["seq_len"].get<int64_t>()),
                Cell(r, "time_s", "%.4f").c_str(), Cell(r, "cpu_s", "%.3f").c_str(),
                Cell(r, "tokens_per_s", "%.0f").c_str(), Cell(r, "gflops_per_s", "%.1f").c_str(),
                Cell(r, "sgemm_fraction", "%.1f%%", 100).c_str(), Cell(r, "peak_bytes", "%.1f", mib).c_str(),
                Cell(r, "activation_peak_bytes", "%.1f", mib).c_str(), Cell(r, "kv_bytes", "%.1f", mib).c_str(),
                Cell(r, "step_peak_bytes", "%.1f", mib).c_str(), Cell(r, "loss", "%.4f").c_str());
  }
}

std::string SvgPathFor(const std::string& json_path) {
  if (absl::EndsWith(json_path, ".json")) return json_path.substr(0, json_path.size() - 5) + ".svg";
  return json_path + ".svg";
}

std::string Chart(const json& rows, const std::vector<std::string>& strategies, const std::string& title) {
  svg::LineChart mem, time;
  mem.set_title("peak memory vs T").set_x_label("sequence length T (tokens)").set_y_label("peak memory (MiB)");
  time.set_title("time vs T").set_x_label("sequence length T (tokens)").set_y_label("forward + backward (s)");
  mem.set_log2_x(true);
  time.set_log2_x(true);
  for (const char* engine : {"seqgrad", "torch", "hf"}) {
    for (size_t si = 0; si < strategies.size(); ++si) {
      svg::Series m, t;
      const bool torch = std::string(engine) != "seqgrad";
      // seqgrad: the engine's own accounting; torch: its allocator's step peak (profiler) + weights and grads.
      m.name = absl::StrCat(engine, " ", strategies[si], torch ? " (profiler)" : "");
      t.name = absl::StrCat(engine, " ", strategies[si]);
      m.color = t.color = svg::Palette(static_cast<int>(si));
      m.dashed = t.dashed = torch;
      for (const json& r : rows) {
        if (r["engine"] != engine || r["strategy"] != strategies[si]) continue;
        const double T = static_cast<double>(r["seq_len"].get<int64_t>());
        if (!torch && r["peak_bytes"].is_number()) {
          m.points.emplace_back(T, Mib(r["peak_bytes"].get<double>()));
        } else if (torch && r.contains("step_peak_bytes") && r["step_peak_bytes"].is_number() &&
                   r.contains("resting_bytes") && r["resting_bytes"].is_number()) {
          m.points.emplace_back(T, Mib(r["step_peak_bytes"].get<double>() + r["resting_bytes"].get<double>()));
        }
        t.points.emplace_back(T, r["time_s"].get<double>());
      }
      if (!m.points.empty()) mem.AddSeries(m);
      if (!t.points.empty()) time.AddSeries(t);
    }
  }
  return svg::RenderPanels({mem, time}, title);
}

const json* FindRow(const json& rows, const std::string& strategy, int64_t T) {
  for (const json& r : rows)
    if (r["engine"] == "seqgrad" && r["strategy"] == strategy && r["seq_len"] == T) return &r;
  return nullptr;
}

// The claims the chunked strategies make, checked on this run's rows: time ratios at each T, and for seco how
// activation memory and total memory grow with T (activations flat; total by the state and its gradient).
json PrintChecks(const json& rows, const std::vector<std::string>& strategies, const std::vector<int64_t>& seq_lens,
                 int64_t state_bytes_per_token) {
  json out;
  json ratios = json::array();
  std::printf("\ntime ratios in this run:\n%7s %12s %15s %16s %15s\n", "T", "seco/full", "spaco/forward", "spaco/seco",
              "forward/full");
  for (int64_t T : seq_lens) {
    auto ratio = [&](const char* a, const char* b) -> json {
      const json* x = FindRow(rows, a, T);
      const json* y = FindRow(rows, b, T);
      if (!x || !y) return nullptr;
      return (*x)["time_s"].get<double>() / (*y)["time_s"].get<double>();
    };
    json r;
    r["seq_len"] = T;
    r["seco_over_full"] = ratio("seco", "full");
    r["spaco_over_forward"] = ratio("spaco", kForwardOnly);
    r["spaco_over_seco"] = ratio("spaco", "seco");
    r["forward_over_full"] = ratio(kForwardOnly, "full");
    auto cell = [](const json& v) { return v.is_number() ? absl::StrFormat("%.3f", v.get<double>()) : "-"; };
    std::printf("%7lld %12s %15s %16s %15s\n", static_cast<long long>(T), cell(r["seco_over_full"]).c_str(),
                cell(r["spaco_over_forward"]).c_str(), cell(r["spaco_over_seco"]).c_str(),
                cell(r["forward_over_full"]).c_str());
    ratios.push_back(r);
  }
  out["time_ratios"] = ratios;

  // How memory grows with T for the strategies that chunk the sequence (activations should not).
  json growth_by_strategy = json::object();
  for (const std::string& name : strategies) {
    if (name != "seco" && name != "seco:offload" && !absl::StartsWith(name, "adjoint")) continue;
    std::vector<int64_t> ts;
    for (int64_t T : seq_lens)
      if (FindRow(rows, name, T)) ts.push_back(T);
    if (ts.size() < 2) continue;
    const int64_t t_lo = *std::min_element(ts.begin(), ts.end()), t_hi = *std::max_element(ts.begin(), ts.end());
    const json& lo = *FindRow(rows, name, t_lo);
    const json& hi = *FindRow(rows, name, t_hi);
    const double act_lo = lo["activation_peak_bytes"].get<double>();
    const double act_hi = hi["activation_peak_bytes"].get<double>();
    const double dT = static_cast<double>(t_hi - t_lo);
    auto per_token = [&](const char* key) { return (hi[key].get<double>() - lo[key].get<double>()) / dT; };
    const double growth = per_token("peak_bytes"), kv_growth = per_token("kv_cache_bytes");
    const double grad_growth = per_token("kv_grad_bytes");
    json m;
    m["t_lo"] = t_lo;
    m["t_hi"] = t_hi;
    m["activation_change"] = act_hi / act_lo - 1;
    m["peak_growth_bytes_per_token"] = growth;
    m["kv_cache_growth_bytes_per_token"] = kv_growth;
    m["kv_grad_growth_bytes_per_token"] = grad_growth;
    m["state_bytes_per_token"] = state_bytes_per_token;
    std::printf("\n%s memory, T=%lld -> %lld:\n", name.c_str(), static_cast<long long>(t_lo),
                static_cast<long long>(t_hi));
    std::printf("  activation peak (activations + workspace + logits at the peak): %.2f -> %.2f MiB (%+.2f%%)\n",
                Mib(act_lo), Mib(act_hi), 100 * (act_hi / act_lo - 1));
    std::printf(
        "  peak growth per token: %.1f bytes = state (KV cache) %.1f + state gradient (KV grad) %.1f + "
        "other %.1f (K+V of one token over all layers: %lld bytes)\n",
        growth, kv_growth, grad_growth, growth - kv_growth - grad_growth,
        static_cast<long long>(state_bytes_per_token));
    std::printf("  peak growth per 10K tokens: %.2f MB\n", growth * 1e4 / 1e6);
    growth_by_strategy[name] = m;
    if (name == "seco") out["seco_memory"] = m;
  }
  out["memory_growth"] = growth_by_strategy;

  // Time vs T as a power law between consecutive lengths: ~1 linear, ~2 quadratic.
  json exponents = json::object();
  std::printf("\ntime exponent d log(time) / d log(T) between consecutive lengths:\n");
  for (const std::string& name : strategies) {
    json e = json::array();
    std::string line;
    const json* prev = nullptr;
    for (int64_t T : seq_lens) {
      const json* r = FindRow(rows, name, T);
      if (!r) continue;
      if (prev) {
        const double x = std::log(static_cast<double>(T) / (*prev)["seq_len"].get<double>());
        const double k = std::log((*r)["time_s"].get<double>() / (*prev)["time_s"].get<double>()) / x;
        e.push_back({{"from", (*prev)["seq_len"]}, {"to", T}, {"exponent", k}});
        absl::StrAppendFormat(&line, "  %lld->%lld: %.2f", (*prev)["seq_len"].get<long long>(),
                              static_cast<long long>(T), k);
      }
      prev = r;
    }
    if (e.empty()) continue;
    exponents[name] = e;
    std::printf("  %-12s%s\n", name.c_str(), line.c_str());
  }
  out["time_exponents"] = exponents;
  return out;
}

// <strategy>:docs against <strategy> on the same tokens, where both ran: how much faster attention within documents
// makes a step (time without the masks / time with them).
json PrintDocumentChecks(const json& rows, const std::vector<std::string>& strategies,
                         const std::vector<int64_t>& seq_lens, int64_t doc_len) {
  json out = json::array();
  for (const std::string& name : strategies) {
    if (!OnDocuments(name)) continue;
    const std::string plain = name.substr(0, name.size() - kDocsSuffix.size());
    for (int64_t T : seq_lens) {
      const json* x = FindRow(rows, plain, T);
      const json* y = FindRow(rows, name, T);
      if (!x || !y) continue;
      if (out.empty())
        std::printf("\npacked documents of %lld tokens: step time without document masks / with them\n",
                    static_cast<long long>(doc_len));
      const double speedup = (*x)["time_s"].get<double>() / (*y)["time_s"].get<double>();
      std::printf("  %-10s T=%7lld: %.2fx (%.0f -> %.0f tok/s)\n", plain.c_str(), static_cast<long long>(T), speedup,
                  (*x)["tokens_per_s"].get<double>(), (*y)["tokens_per_s"].get<double>());
      out.push_back({{"strategy", plain}, {"seq_len", T}, {"doc_len", doc_len}, {"speedup", speedup}});
    }
  }
  return out;
}

// --tp=N: see the flag. Returns the exit code.
int TensorParallelBench(dist::Communicator& world, int tp, Model& whole, const StrategyOptions& base,
                        const std::vector<std::string>& strategies, const std::vector<int64_t>& seq_lens,
                        const std::map<int64_t, Sequence>& seqs, double spaco_fraction, int warmup, int repeats,
                        const std::string& json_path) {
  absl::StatusOr<dist::TensorParallelGrid> grid = dist::CreateTensorParallelGrid(world, tp);
  tools::ExitIfError(grid.status(), "--tp");
  if (grid->dp->size() != 1)
    Fail("--tp", absl::StrCat("bench times one tensor-parallel group: launch mpirun -np ", tp, ", not ", world.size()));
  absl::StatusOr<std::unique_ptr<Model>> split = dist::SplitModel(whole, grid->layers());
  tools::ExitIfError(split.status(), "--tp");
  const int threads = omp_get_max_threads();
  std::printf(
      "\ntensor parallel: %d ranks x %d thread(s) against one rank x %d threads (the same cores); best of %d\n"
      "%-8s %7s %9s %9s %8s %12s %10s %11s %11s\n",
      tp, threads, tp * threads, repeats, "strategy", "T", "tp=1 s", absl::StrCat("tp=", tp, " s").c_str(), "speedup",
      "reduced MB", "B/token", "peak MiB 1", absl::StrCat("peak MiB ", tp).c_str());
  json rows = json::array();
  for (const std::string& name : strategies) {
    for (int64_t T : seq_lens) {
      const bool forward_only = name == kForwardOnly;
      double one_s = std::numeric_limits<double>::infinity(), split_s = one_s;
      int64_t reduced = 0, one_peak = 0, split_peak = 0;
      for (int round = 0; round < warmup + repeats; ++round) {
        StrategyOptions so = OptionsFor(base, name, T, spaco_fraction);
        so.seed += static_cast<uint64_t>(round);
        if (world.rank() == 0) {  // the others wait (the MPI communicator's waits sleep)
          omp_set_num_threads(tp * threads);
          absl::StatusOr<Measurement> m = Measure(whole, so, forward_only, seqs.at(T), 0, 1, /*rss=*/false);
          omp_set_num_threads(threads);
          tools::ExitIfError(m.status(), absl::StrCat("--tp: strategy ", name, " T=", T, ", one rank").c_str());
          if (round >= warmup) one_s = std::min(one_s, m->best_s), one_peak = m->mem.total_peak;
        }
        tools::ExitIfError(world.Barrier(), "--tp");
        const int64_t before = grid->tp->bytes_communicated();
        absl::StatusOr<Measurement> m = Measure(**split, so, forward_only, seqs.at(T), 0, 1, /*rss=*/false);
        tools::ExitIfError(m.status(), absl::StrCat("--tp: strategy ", name, " T=", T, ", split").c_str());
        const int64_t sent = grid->tp->bytes_communicated() - before;
        std::vector<double> slowest = {m->best_s};  // a step ends when its last rank does
        tools::ExitIfError(world.AllReduce(slowest, dist::ReduceOp::kMax), "--tp");
        if (round >= warmup) split_s = std::min(split_s, slowest[0]), reduced = sent, split_peak = m->mem.total_peak;
      }
      std::printf("%-8s %7lld %9.4f %9.4f %7.2fx %12.2f %10.0f %11.1f %11.1f\n", name.c_str(),
                  static_cast<long long>(T), one_s, split_s, one_s / split_s, reduced / 1e6,
                  static_cast<double>(reduced) / T, Mib(one_peak), Mib(split_peak));
      rows.push_back({{"strategy", name},
                      {"seq_len", T},
                      {"tp", tp},
                      {"threads_per_rank", threads},
                      {"time_s_tp1", one_s},
                      {"time_s_split", split_s},
                      {"speedup", one_s / split_s},
                      {"bytes_all_reduced_per_rank", reduced},
                      {"bytes_all_reduced_per_token", static_cast<double>(reduced) / T},
                      {"peak_bytes_tp1", one_peak},
                      {"peak_bytes_split", split_peak}});
    }
  }
  if (!json_path.empty() && world.rank() == 0)
    tools::ExitIfError(
        tools::WriteTextFile(tools::ResolveUserPath(json_path),
                             json({{"model", absl::GetFlag(FLAGS_model)}, {"tensor_parallel", rows}}).dump(2) + "\n"),
        "--json");
  return 0;
}

int Main() {
  // --census: before --device is checked, so that `--device=cuda --census` counts on any machine.
  if (absl::GetFlag(FLAGS_census) && !absl::GetFlag(FLAGS_config_overrides).empty())
    Fail("--census", "counts a preset or a model directory as it is: drop --config_overrides");
  if (absl::GetFlag(FLAGS_census))
    return tools::CensusMain(absl::GetFlag(FLAGS_strategies), absl::GetFlag(FLAGS_seq_lens), absl::GetFlag(FLAGS_json));

  // --tp: join the mpirun job first, so that every later error is a rank's own; rank 0 prints.
  const int tp = absl::GetFlag(FLAGS_tp);
  std::unique_ptr<dist::Communicator> world;
  if (tp != 1) {
    if (tp < 1) Fail("--tp", absl::StrCat("must be at least 1, got ", tp));
    absl::StatusOr<std::unique_ptr<dist::Communicator>> c = dist::JoinMpiJob("--tp");
    tools::ExitIfError(c.status(), "--tp");
    world = std::move(*c);
    if (world->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;
  }
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  const Device device = tools::DeviceFromFlags();
  const std::vector<std::string> strategies = SplitList(absl::GetFlag(FLAGS_strategies));
  if (strategies.empty()) Fail("--strategies", "empty");
  StrategyOptions base = tools::StrategyFromFlags();
  for (const std::string& s : strategies) {
    tools::ExitIfError(ValidateStrategyOptions(OptionsFor(base, s, 1, 0)), "--strategies");
  }
  const double spaco_fraction = absl::GetFlag(FLAGS_spaco_fraction);
  if (!(spaco_fraction >= 0 && spaco_fraction <= 1)) Fail("--spaco_fraction", "must be in [0, 1]");
  std::vector<int64_t> seq_lens;
  for (const std::string& s : SplitList(absl::GetFlag(FLAGS_seq_lens))) {
    int64_t T;
    if (!absl::SimpleAtoi(s, &T) || T <= 0) Fail("--seq_lens", absl::StrCat("'", s, "' is not a positive integer"));
    seq_lens.push_back(T);
  }
  if (seq_lens.empty()) Fail("--seq_lens", "empty");
  const int repeats = absl::GetFlag(FLAGS_repeats), warmup = absl::GetFlag(FLAGS_warmup);
  if (repeats < 1) Fail("--repeats", "must be at least 1");
  if (warmup < 0) Fail("--warmup", "must be >= 0");
  const std::string task = absl::GetFlag(FLAGS_task);
  if (task != "random" && task != "retrieval") Fail("--task", absl::StrCat("'", task, "' (random, retrieval)"));
  const int64_t budget = absl::GetFlag(FLAGS_memory_budget);
  if (budget < 0) Fail("--memory_budget", "must be >= 0");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const bool compare_torch = absl::GetFlag(FLAGS_compare_torch);

  absl::StatusOr<std::unique_ptr<Model>> loaded = LoadBenchModel(*dtype, seed, device, base.offload_experts && !world);
  tools::ExitIfError(loaded.status(), absl::GetFlag(FLAGS_config_overrides).empty() ? "--model" : "--config_overrides");
  Model& model = **loaded;
  const ModelFacts facts = Describe(model);
  if (compare_torch && model.family() != "transformer")
    Fail("--compare_torch", "bench_torch.py implements the transformer family only");
  // --lora_*: adapters on, base frozen, as train runs them (a LoRA step's memory and time).
  const std::string lora = tools::ApplyLoraFlags(model);
  if (!lora.empty() && compare_torch) Fail("--compare_torch", "bench_torch.py trains every weight: drop --lora_rank");
  const int threads = omp_get_max_threads();

  // The yardstick FLOP rates are divided by: the CPU's measured sgemm rate, or on a GPU its peak dense matmul
  // rate in the --matmul mode (the fraction is then the MFU).
  const DeviceBackend* backend = FindBackend(device);
  const bool gpu = device == Device::kCUDA;
  const SgemmRates sgemm_rates = gpu ? SgemmRates{} : MeasureSgemmGflops();
  const double sgemm = gpu ? backend->peak_flops(*dtype == DType::kF64) / 1e9 : sgemm_rates.best();
  if (gpu && !(sgemm > 0)) Fail("--device", "the peak FLOP rate of this GPU is unknown (sm_80 and sm_90 are)");
  // Caps the tracker at the GPU's free memory: a length that does not fit fails clearly (and is reported as the
  // end of that strategy's rows) before the device runs out.
  if (gpu) tools::ExitIfError(tools::CheckDeviceMemory(model, base, 0), "--device");
  std::printf("seqgrad bench: model=%s (%s) dtype=%s device=%s matmul=%s threads=%d task=%s repeats=%d warmup=%d%s\n",
              absl::GetFlag(FLAGS_model).c_str(), facts.description.c_str(), DTypeName(*dtype), DeviceName(device),
              absl::GetFlag(FLAGS_matmul).c_str(), threads, task.c_str(), repeats, warmup,
              lora.empty() ? "" : absl::StrCat(" ", lora).c_str());
  if (gpu)
    std::printf("gpu: %s, peak %.1f GFLOP/s (%%sgemm column = MFU)\n", backend->name().c_str(), sgemm);
  else
    std::printf(
        "sgemm_gflops: %.1f (1024^3, %d threads, the faster of OpenBLAS cblas_sgemm %.1f and the engine's "
        "f32 GEMM under --matmul=%s %.1f)\n",
        sgemm, threads, sgemm_rates.openblas, absl::GetFlag(FLAGS_matmul).c_str(), sgemm_rates.engine);
  std::fflush(stdout);

  std::map<int64_t, Sequence> seqs, doc_seqs;  // doc_seqs: the same tokens as documents of --doc_len
  const int64_t doc_len = absl::GetFlag(FLAGS_doc_len);
  if (doc_len < 2) Fail("--doc_len", absl::StrCat("must be at least 2, got ", doc_len));
  for (int64_t T : seq_lens) {
    seqs.emplace(T, MakeSequence(task, T, model.vocab_size(), seed));
    doc_seqs.emplace(T, AsDocuments(seqs.at(T), doc_len));
  }
  auto seq_for = [&](const std::string& name, int64_t T) -> const Sequence& {
    return OnDocuments(name) ? doc_seqs.at(T) : seqs.at(T);
  };

  if (world && (compare_torch || budget > 0))
    Fail("--tp", "times the split model alone: drop --compare_torch and --memory_budget");
  if (world && std::any_of(strategies.begin(), strategies.end(), OnDocuments)) Fail("--tp", "runs no :docs strategy");
  if (world)
    return TensorParallelBench(*world, tp, model, base, strategies, seq_lens, seqs, spaco_fraction, warmup, repeats,
                               absl::GetFlag(FLAGS_json));

  const int64_t state_bytes_per_token = model.StateBytesPerToken();
  json rows = json::array();
  // Rounds interleave the strategies (A B C, A B C, ...) so that a slow spell of a shared machine hits all of
  // them alike; the first --warmup rounds are not timed. Every round is a fresh Trainer with its own sampling seed.
  std::map<std::pair<std::string, int64_t>, Measurement> measured;
  std::map<std::string, std::string> skipped;  // strategy -> why its longer sequences were not run
  const double skip_after_s = absl::GetFlag(FLAGS_skip_after_s);
  json skipped_rows = json::array();
  // PyTorch runs right after seqgrad at each length (not after all of them), so that both meet much the same load
  // on a shared machine; its rows are printed after seqgrad's.
  std::vector<std::string> torch_strategies;
  if (const std::string list = absl::GetFlag(FLAGS_torch_strategies); !list.empty()) {
    torch_strategies = SplitList(list);
    for (const std::string& s : torch_strategies)
      if (!IsTorchStrategy(s)) Fail("--torch_strategies", absl::StrCat("'", s, "' (full, ckpt, full:docs, ckpt:docs)"));
  } else {
    for (const std::string& s : strategies)
      if (IsTorchStrategy(s)) torch_strategies.push_back(s);
  }
  if (compare_torch && torch_strategies.empty())
    std::fprintf(stderr, "--compare_torch: bench_torch.py knows only full and ckpt; nothing to compare\n");
  json torch_info = json::object(), torch_rows = json::array();
  std::string torch_error;  // the first failure of the PyTorch side: no more PyTorch runs, exit status 1
  auto run_torch = [&](int64_t T) {
    if (!compare_torch || torch_strategies.empty() || !torch_error.empty()) return;
    absl::StatusOr<json> ran =
        RunTorch(model, torch_strategies, {{T, seqs.at(T)}}, warmup, repeats, DTypeName(*dtype), gpu);
    if (!ran.ok()) {
      torch_error = std::string(ran.status().message());
      std::fprintf(stderr, "--compare_torch: %s; seqgrad's rows are still reported\n", torch_error.c_str());
      return;
    }
    json& t = *ran;
    for (json r : t["rows"]) {
      if (!r["time_s"].is_number()) {  // out of GPU memory
        skipped_rows.push_back(
            {{"engine", r["engine"]}, {"strategy", r["strategy"]}, {"seq_len", T}, {"reason", "out of GPU memory"}});
        continue;
      }
      const double flops = facts.useful_flops(T, ValidLabels(seqs.at(T)));
      const double secs = r["time_s"].get<double>();
      r["gflops"] = flops / 1e9;
      r["gflops_per_s"] = flops / 1e9 / secs;
      r["sgemm_fraction"] = flops / 1e9 / secs / sgemm;
      torch_rows.push_back(r);
    }
    t.erase("rows");
    torch_info = t;
  };
  for (int64_t T : seq_lens) {
    for (int round = 0; round < warmup + repeats; ++round) {
      for (const std::string& name : strategies) {
        if (skipped.count(name)) {
          if (round == 0) {
            std::fprintf(stderr, "skipping %s T=%lld: %s\n", name.c_str(), static_cast<long long>(T),
                         skipped[name].c_str());
            skipped_rows.push_back({{"strategy", name}, {"seq_len", T}, {"reason", skipped[name]}});
          }
          continue;
        }
        StrategyOptions so = OptionsFor(base, name, T, spaco_fraction);
        so.seed += static_cast<uint64_t>(round);
        absl::StatusOr<Measurement> m = Measure(model, so, name == kForwardOnly, seq_for(name, T), 0, 1, /*rss=*/true);
        if (absl::IsResourceExhausted(m.status())) {  // the longest T that fits is the one before
          skipped[name] = absl::StrCat("out of memory at T=", T, ": ", m.status().message());
          skipped_rows.push_back({{"strategy", name}, {"seq_len", T}, {"reason", skipped[name]}});
          std::fprintf(stderr, "%s T=%lld: %s\n", name.c_str(), static_cast<long long>(T), skipped[name].c_str());
          continue;
        }
        tools::ExitIfError(m.status(), absl::StrCat("strategy ", name, " T=", T).c_str());
        if (skip_after_s > 0 && m->best_s > skip_after_s)
          skipped[name] = absl::StrFormat("T=%d took %.1f s > --skip_after_s=%g", T, m->best_s, skip_after_s);
        if (round < warmup) continue;
        auto [it, first] = measured.try_emplace({name, T}, *m);
        Measurement& acc = it->second;
        if (first) {
          acc.mean_s = acc.chunks = acc.chunks_backpropagated = 0;
        } else {
          acc.best_s = std::min(acc.best_s, m->best_s);
          acc.best_cpu_s = std::min(acc.best_cpu_s, m->best_cpu_s);
          acc.rss_delta = std::max(acc.rss_delta, m->rss_delta);
        }
        acc.mean_s += m->mean_s / repeats;
        acc.chunks += m->chunks / repeats;
        acc.chunks_backpropagated += m->chunks_backpropagated / repeats;
      }
    }
    run_torch(T);
  }
  for (const std::string& name : strategies) {
    for (int64_t T : seq_lens) {
      const StrategyOptions so = OptionsFor(base, name, T, spaco_fraction);
      if (!measured.count({name, T})) continue;  // skipped
      const Measurement& m = measured.at({name, T});
      double flops = facts.useful_flops(T, ValidLabels(seq_for(name, T)));
      if (name == kForwardOnly) flops /= 3;  // forward is a third of forward + backward
      json row = SeqgradRow(name, T, m, flops, sgemm, state_bytes_per_token);
      if (OnDocuments(name)) row["doc_len"] = doc_len;
      // spaco's useful work is random, sparse attention's depends on the selection, documents' attention is the sum
      // of their squares: no FLOP rate for them.
      if (name == "spaco" || (so.sparse_pages > 0 && so.name == "seco") || OnDocuments(name))
        for (const char* k : {"gflops", "gflops_per_s", "sgemm_fraction"}) row[k] = nullptr;
      if (name == "spaco") {
        row["spaco_budget"] = so.spaco_budget;
        row["spaco_cap"] = so.spaco_cap;
      }
      if (so.name == "adjoint") {
        row["adjoint_form"] = so.adjoint_form;
        row["adjoint_window"] =
            so.adjoint_window == StrategyOptions::kNoAdjointWindow ? json(nullptr) : json(so.adjoint_window);
        row["adjoint_pairs_per_layer"] = m.adjoint_pairs / model.num_layers();
      }
      std::fprintf(stderr, "seqgrad %8s T=%6lld: %.4f s  %.0f tok/s  peak %.1f MiB  loss %.5f  chunks %.1f/%.1f\n",
                   name.c_str(), static_cast<long long>(T), row["time_s"].get<double>(),
                   row["tokens_per_s"].get<double>(), Mib(m.mem.total_peak), m.loss, m.chunks_backpropagated, m.chunks);
      rows.push_back(row);
    }
  }
  json checks = PrintChecks(rows, strategies, seq_lens, state_bytes_per_token);
  checks["documents"] = PrintDocumentChecks(rows, strategies, seq_lens, doc_len);

  for (json& r : torch_rows) rows.push_back(std::move(r));

  std::printf("\n");
  PrintTable(rows);

  // seqgrad / torch per (strategy, T), and how well the two losses agree (same weights, same tokens).
  json ratios = json::array();
  if (compare_torch) {
    std::printf("\nPyTorch engines:\n");
    const json labels = torch_info.value("labels", json::object());
    const json skipped_engines = torch_info.value("skipped_engines", json::object());
    for (const auto& [engine, label] : labels.items())
      std::printf("  %-6s %s\n", engine.c_str(), label.get<std::string>().c_str());
    for (const auto& [engine, why] : skipped_engines.items())
      std::printf("  %-6s skipped: %s\n", engine.c_str(), why.get<std::string>().c_str());
    std::printf(
        "\nseqgrad / PyTorch tokens/s (and the same by CPU seconds per step, steadier on a shared machine); seco and "
        "streambp against PyTorch's full:\n"
        "%-8s %-10s %7s %12s %12s %8s %10s %12s\n",
        "strategy", "vs", "T", "seqgrad tok/s", "torch tok/s", "ratio", "cpu ratio", "loss rel.diff");
    for (const json& a : rows) {
      if (a["engine"] != "seqgrad") continue;
      const std::string strategy = a["strategy"].get<std::string>();
      const std::string counterpart =
          TorchCounterpart(strategy, OptionsFor(base, strategy, a["seq_len"].get<int64_t>(), spaco_fraction));
      for (const json& b : rows) {
        if (b["engine"] == "seqgrad" || b["strategy"] != counterpart || b["seq_len"] != a["seq_len"]) continue;
        const double ra = a["tokens_per_s"].get<double>(), rb = b["tokens_per_s"].get<double>();
        const double la = a["loss"].get<double>(), lb = b["loss"].get<double>();
        const double diff = std::fabs(la - lb) / std::max(1e-12, std::fabs(lb));
        json r;
        r["strategy"] = a["strategy"];
        r["versus"] = b["engine"];
        r["torch_strategy"] = counterpart;
        r["seq_len"] = a["seq_len"];
        r["seqgrad_tokens_per_s"] = ra;
        r["torch_tokens_per_s"] = rb;
        r["seqgrad_over_torch"] = ra / rb;
        const bool cpu_known = a.contains("cpu_s") && b.contains("cpu_s") && b["cpu_s"].is_number();
        r["seqgrad_over_torch_by_cpu_time"] =
            cpu_known ? json(b["cpu_s"].get<double>() / a["cpu_s"].get<double>()) : json(nullptr);
        r["loss_rel_diff"] = diff;
        ratios.push_back(r);
        const std::string cpu_ratio =
            cpu_known ? absl::StrFormat("%.2fx", r["seqgrad_over_torch_by_cpu_time"].get<double>()) : "-";
        const std::string versus = b["engine"].get<std::string>() + (counterpart == strategy ? "" : " " + counterpart);
        std::printf("%-8s %-10s %7lld %12.0f %12.0f %7.2fx %10s %12.2e\n", strategy.c_str(), versus.c_str(),
                    static_cast<long long>(a["seq_len"].get<int64_t>()), ra, rb, ra / rb, cpu_ratio.c_str(), diff);
      }
    }
  }

  json budget_rows = json::array();
  if (budget > 0) {
    const int64_t t0 = *std::min_element(seq_lens.begin(), seq_lens.end());
    std::fprintf(stderr, "memory budget search: %lld bytes, from T=%lld, cap %lld\n", static_cast<long long>(budget),
                 static_cast<long long>(t0), static_cast<long long>(kBudgetCap));
    for (const std::string& name : strategies)
      budget_rows.push_back(BudgetSearch(model, base, name, spaco_fraction, t0, budget, task, seed));
    std::printf("\nlongest sequence within a budget of %.1f MiB (%lld bytes):\n", Mib(budget),
                static_cast<long long>(budget));
    for (const json& b : budget_rows)
      std::printf("  %-8s max_seq_len_in_budget %lld%s\n", b["strategy"].get<std::string>().c_str(),
                  static_cast<long long>(b["max_seq_len_in_budget"].get<int64_t>()),
                  b.contains("error") ? absl::StrCat("  (", b["error"].get<std::string>(), ")").c_str() : "");
  }

  if (const std::string jpath = absl::GetFlag(FLAGS_json); !jpath.empty()) {
    const std::string path = tools::ResolveUserPath(jpath);
    if (const fs::path parent = fs::path(path).parent_path(); !parent.empty()) {
      std::error_code ec;
      fs::create_directories(parent, ec);  // WriteTextFile reports what still fails
    }
    json config;
    config["model"] = absl::GetFlag(FLAGS_model);
    config["config_overrides"] = absl::GetFlag(FLAGS_config_overrides);
    config["description"] = facts.description;
    for (const auto& [k, v] : facts.config.items()) config[k] = v;
    config["dtype"] = DTypeName(*dtype);
    config["device"] = DeviceName(device);
    config["matmul"] = absl::GetFlag(FLAGS_matmul);
    if (gpu) config["gpu"] = backend->name();
    config["threads"] = threads;
    const char* wait_policy = std::getenv("OMP_WAIT_POLICY");  // tools::InitTool sets PASSIVE unless the user did
    config["omp_wait_policy"] = wait_policy ? wait_policy : "";
    // The CPU kernels' environment switches (kernels/cpu: isa.h, bf16.cc), as this run had them.
    for (const char* env : {"SG_CPU_ISA", "SG_GEMM"}) {
      const char* v = std::getenv(env);
      config[absl::AsciiStrToLower(env)] = v ? v : "";
    }
    config["task"] = task;
    config["batch"] = 1;
    config["strategies"] = strategies;
    config["seq_lens"] = seq_lens;
    config["repeats"] = repeats;
    config["warmup"] = warmup;
    config["chunk"] = base.chunk;
    config["page_size"] = base.page_size;
    config["sparse_pages"] = base.sparse_pages;
    config["offload"] = base.offload;
    config["lm_chunk"] = base.lm_chunk;
    config["lora"] = json::parse(tools::LoraJson(model));
    config["seed"] = seed;
    config["skip_after_s"] = skip_after_s;
    config["memory_budget"] = budget;
    config["compare_torch"] = compare_torch;
    json out;
    out["rows"] = rows;
    out["sgemm_gflops"] = sgemm;
    if (!gpu) out["sgemm_gflops_by_library"] = {{"openblas", sgemm_rates.openblas}, {"engine", sgemm_rates.engine}};
    out["config"] = config;
    if (compare_torch) {
      out["ratios"] = ratios;
      out["torch"] = torch_info;
      if (!torch_error.empty()) out["torch_error"] = torch_error;
    }
    if (budget > 0) out["budget"] = budget_rows;
    if (!skipped_rows.empty()) out["skipped"] = skipped_rows;
    out["checks"] = checks;
    tools::ExitIfError(tools::WriteTextFile(path, out.dump(2) + "\n"), "--json");
    const std::string svg_path = SvgPathFor(path);
    const std::string title = absl::StrCat("seqgrad bench: ", absl::GetFlag(FLAGS_model), ", ", threads,
                                           " threads, sgemm ", absl::StrFormat("%.0f", sgemm), " GFLOP/s");
    tools::ExitIfError(tools::WriteTextFile(svg_path, Chart(rows, strategies, title)), "--json (chart)");
    std::printf("\nwrote %s and %s\n", path.c_str(), svg_path.c_str());
  }
  if (!torch_error.empty()) Fail("--compare_torch", torch_error);
  return 0;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  sg::tools::InitTool(
      argc, argv,
      "Benchmark gradient strategies: time, tokens/s, FLOP rate and engine-accounted memory per sequence length.\n"
      "  bench --model=bench-cpu --strategies=full,ckpt --seq_lens=1024,2048,4096 [--compare_torch] "
      "[--memory_budget=BYTES] --json=out.json");
  return sg::tools::RunTool("bench", sg::Main);
}
