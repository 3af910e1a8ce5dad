// Plans a training run's memory without running it: the engine walks one step's exact allocation schedule on the
// meta device (shapes and byte accounting, no storage, no compute; core/plan.h) and prints the peak bytes of each
// category on the device, and for --offload and --offload_experts the host bytes; --memory=BYTES finds the longest --seq_len that fits.
// The plan is of this engine's CPU backend schedule (what plan_test checks byte for byte against the CPU); a GPU
// adds its runtime's own memory (CUDA context, cuBLAS workspace) on top.
#include <cstdio>
#include <limits>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/plan.h"
#include "nlohmann/json.hpp"
#include "distributed/tensor_parallel.h"
#include "cli/common.h"

ABSL_FLAG(int64_t, seq_len, 4096, "tokens per sequence (dpo: of each response of the pair; grpo: of each completion)");
ABSL_FLAG(std::string, memory, "",
          "device memory in bytes (suffixes K, M, G, T: powers of 1024, e.g. 80G): print the longest --seq_len whose "
          "step fits instead");
ABSL_FLAG(int64_t, max_seq_len, int64_t{1} << 24, "--memory: the longest --seq_len the search tries");
ABSL_FLAG(bool, json, false, "print the plan as one JSON object instead of a table");
ABSL_FLAG(int, tp, 1, "plan one rank of a tensor-parallel run over this many GPUs (docs/distributed.md)");
ABSL_FLAG(int64_t, doc_len, 0,
          "sft: plan the sequence as packed documents of this many tokens (attention within each); 0 = one document");

namespace sg {
namespace {

absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  std::string digits = absl::AsciiStrToUpper(text);
  int shift = 0;
  if (!digits.empty()) {
    const char unit = digits.back();
    shift = unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : unit == 'T' ? 40 : 0;
    if (shift) digits.pop_back();
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n) || n <= 0 || n > (std::numeric_limits<int64_t>::max() >> shift))
    return absl::InvalidArgumentError(
        absl::StrCat("--memory: '", text, "' is not a positive byte count below 2^63 (e.g. 85899345920 or 80G)"));
  return n << shift;
}

std::string Gib(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / 1073741824.0); }

int Main() {
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  if (absl::GetFlag(FLAGS_device) != "cpu" && absl::GetFlag(FLAGS_device) != "meta")
    tools::ExitIfError(absl::InvalidArgumentError("plan always runs on --device=meta (it plans for any device)"),
                       "--device");
  if (!absl::GetFlag(FLAGS_lora_init).empty())
    tools::ExitIfError(absl::InvalidArgumentError("plan reads no weights: give the adapter's --lora_rank and "
                                                  "--lora_targets instead"),
                       "--lora_init");
  const StrategyOptions strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(strategy), "flags");
  const ObjectiveOptions objective = tools::ObjectiveFromFlags();
  tools::ExitIfError(ValidateObjectiveOptions(objective), "flags");
  const std::string spec = tools::ModelSpec();
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreatePlanModel(spec, *dtype, Device::kMeta, LoraOptions{}, absl::GetFlag(FLAGS_seed));
  tools::ExitIfError(model.status(), "--model");
  const std::string lora = tools::ApplyLoraFlags(**model);
  if (const int tp = absl::GetFlag(FLAGS_tp); tp != 1) {  // rank 0's blocks; the others' are the same size
    model = dist::SplitModel(**model, TensorParallel{0, tp, nullptr});
    tools::ExitIfError(model.status(), "--tp");
  }
  tools::ExitIfError(ValidateStrategyForModel(strategy, **model), "flags");

  const std::string memory_text = absl::GetFlag(FLAGS_memory);
  int64_t memory = 0;
  absl::StatusOr<MemoryPlan> plan;
  if (memory_text.empty()) {
    plan = PlanStep(**model, strategy, objective, absl::GetFlag(FLAGS_seq_len), /*limit=*/0,
                    absl::GetFlag(FLAGS_doc_len));
    tools::ExitIfError(plan.status(), "plan");
  } else {
    absl::StatusOr<int64_t> parsed = ParseBytes(memory_text);
    tools::ExitIfError(parsed.status(), "flags");
    memory = *parsed;
    const int64_t max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
    if (max_seq_len <= 0)
      tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--max_seq_len must be positive, got ", max_seq_len)),
                         "flags");
    plan = LongestFit(**model, strategy, objective, memory, max_seq_len);
    tools::ExitIfError(plan.status(), "plan");
  }
  const MemorySnapshot& s = plan->device;
  const std::string strategy_text = absl::StrCat(
      strategy.name, " chunk=", strategy.chunk, " page_size=", strategy.page_size, " lm_chunk=", strategy.lm_chunk,
      strategy.offload ? " offload" : "", strategy.offload_experts ? " offload_experts" : "",
      strategy.sparse_pages > 0 ? absl::StrCat(" sparse_pages=", strategy.sparse_pages) : "");
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::ordered_json j;
    j["model"] = spec;
    j["family"] = (*model)->family();
    j["dtype"] = DTypeName(*dtype);
    j["strategy"] = strategy_text;
    j["objective"] = objective.name;
    j["lora"] = nlohmann::ordered_json::parse(tools::LoraJson(**model));
    j["tp"] = absl::GetFlag(FLAGS_tp);
    j["seq_len"] = plan->seq_len;
    j["memory"] = memory ? nlohmann::ordered_json(memory) : nlohmann::ordered_json(nullptr);
    for (int i = 0; i < kNumMemCategories; ++i) {
      j["device_peak"][MemCategoryName(static_cast<MemCategory>(i))] = s.peak[i];
      j["device_at_total_peak"][MemCategoryName(static_cast<MemCategory>(i))] = s.at_total_peak[i];
    }
    j["device_total_peak"] = s.total_peak;
    j["host_bytes"] = plan->host_bytes;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("plan of one training step on --device=meta (no storage, no compute): %s, %s, %d layers, %s%s\n",
              spec.c_str(), (*model)->family().c_str(), (*model)->num_layers(), DTypeName(*dtype),
              absl::GetFlag(FLAGS_tp) > 1 ? absl::StrCat(", one rank of --tp=", absl::GetFlag(FLAGS_tp)).c_str() : "");
  std::printf("strategy %s, objective %s%s\n", strategy_text.c_str(), objective.name.c_str(),
              lora.empty() ? "" : absl::StrCat("; ", lora).c_str());
  if (memory) std::printf("longest --seq_len that fits in %lld bytes (%s): %lld tokens\n",
                          static_cast<long long>(memory), Gib(memory).c_str(), static_cast<long long>(plan->seq_len));
  else std::printf("--seq_len=%lld\n", static_cast<long long>(plan->seq_len));
  std::printf("\n%-14s %20s %14s %20s\n", "device", "peak bytes", "", "at the total's peak");
  for (int i = 0; i < kNumMemCategories; ++i)
    std::printf("%-14s %20lld %14s %20lld\n", MemCategoryName(static_cast<MemCategory>(i)),
                static_cast<long long>(s.peak[i]), Gib(s.peak[i]).c_str(),
                static_cast<long long>(s.at_total_peak[i]));
  std::printf("%-14s %20lld %14s\n", "total", static_cast<long long>(s.total_peak), Gib(s.total_peak).c_str());
  if (strategy.offload || strategy.offload_experts)
    std::printf("host (offloaded KV and KV-gradient pages, expert weights): %lld bytes (%s)\n",
                static_cast<long long>(plan->host_bytes), Gib(plan->host_bytes).c_str());
  return 0;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  sg::tools::InitTool(argc, argv,
                      "Plan a training run's memory on the meta device: plan --model=qwen2.5-7b --strategy=seco "
                      "--chunk=4096 --lora_rank=16 --seq_len=131072 [--offload] [--offload_experts] [--sparse_pages=k] [--memory=80G] "
                      "[--json]");
  return sg::tools::RunTool("plan", sg::Main);
}
