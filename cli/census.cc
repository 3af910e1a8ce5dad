#include "cli/census.h"

#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/census.h"
#include "cli/common.h"
#include "nlohmann/json.hpp"

namespace sg::tools {
namespace {

using json = nlohmann::ordered_json;

const char* Bound(const FamilyTotals& f) { return 2 * f.compute_seconds >= f.seconds ? "compute" : "memory"; }

json FamilyJson(const FamilyTotals& f) {
  json j;
  j["calls"] = f.calls;
  j["flops"] = f.flops;
  j["bytes"] = f.bytes;
  j["roofline_ms"] = f.seconds * 1e3;
  j["bound"] = Bound(f);
  return j;
}

void PrintFamily(const char* name, const FamilyTotals& f, double total_seconds) {
  std::printf("  %-14s %9lld %12.1f %10.2f %12.3f %6.1f%%  %s\n", name, static_cast<long long>(f.calls),
              f.flops / 1e9, f.bytes / 1e9, f.seconds * 1e3, 100 * f.seconds / total_seconds, Bound(f));
}

}  // namespace

int CensusMain(const std::string& strategies, const std::string& seq_lens, const std::string& json_path) {
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  ExitIfError(dtype.status(), "--dtype");
  std::vector<int64_t> lengths;
  for (absl::string_view s : absl::StrSplit(seq_lens, ',', absl::SkipWhitespace())) {
    int64_t T = 0;
    if (!absl::SimpleAtoi(s, &T) || T <= 0)
      ExitIfError(absl::InvalidArgumentError(absl::StrCat("'", s, "' is not a positive integer")), "--seq_lens");
    lengths.push_back(T);
  }
  std::vector<std::string> names = absl::StrSplit(strategies, ',', absl::SkipWhitespace());
  if (lengths.empty() || names.empty())
    ExitIfError(absl::InvalidArgumentError("--census needs --strategies and --seq_lens"), "flags");
  const RooflineLimits limits;
  const std::string spec = ModelSpec();
  std::printf("roofline census (a model, not a measurement): one training step (sft, AdamW) counted on the meta "
              "device, the CUDA backend's kernels at H100 SXM limits: %.0f TFLOP/s dense bf16 (every GEMM, f32 "
              "operands as with --matmul=bf16), %.2f TB/s; launch latency not modelled\n",
              limits.peak_flops / 1e12, limits.bandwidth / 1e12);
  std::printf("model=%s dtype=%s chunk=%lld page_size=%lld lm_chunk=%lld (--device=%s: counted, not run)\n",
              spec.c_str(), DTypeName(*dtype), static_cast<long long>(absl::GetFlag(FLAGS_chunk)),
              static_cast<long long>(absl::GetFlag(FLAGS_page_size)),
              static_cast<long long>(absl::GetFlag(FLAGS_lm_chunk)), absl::GetFlag(FLAGS_device).c_str());
  json out;
  out["model"] = spec;
  out["dtype"] = DTypeName(*dtype);
  out["limits"] = {{"peak_flops", limits.peak_flops}, {"bandwidth_bytes_per_s", limits.bandwidth}};
  out["rows"] = json::array();
  for (const std::string& name : names) {
    if (name.find(':') != std::string::npos)
      ExitIfError(absl::InvalidArgumentError(absl::StrCat("'", name, "': --census takes plain strategy names")),
                  "--strategies");
    StrategyOptions strategy = StrategyFromFlags();
    strategy.name = name;
    for (int64_t T : lengths) {
      absl::StatusOr<StepCensus> c = CensusOfStep(spec, *dtype, strategy, T, Device::kMeta, limits);
      ExitIfError(c.status(), absl::StrCat("census of ", name, " at T=", T).c_str());
      const FamilyTotals total = c->ops.Total();
      std::printf("\n%s T=%lld\n  %-14s %9s %12s %10s %12s %7s  %s\n", name.c_str(), static_cast<long long>(T),
                  "family", "calls", "GFLOP", "GB", "roofline ms", "share", "bound");
      json row;
      row["strategy"] = name;
      row["seq_len"] = T;
      for (int i = 0; i < kNumOpFamilies; ++i) {
        const FamilyTotals& f = c->ops.family(static_cast<OpFamily>(i));
        if (f.calls == 0) continue;
        PrintFamily(OpFamilyName(static_cast<OpFamily>(i)), f, total.seconds);
        row["families"][OpFamilyName(static_cast<OpFamily>(i))] = FamilyJson(f);
      }
      PrintFamily("total", total, total.seconds);
      row["total"] = FamilyJson(total);
      if (c->model_flops > 0) {
        std::printf("  model FLOPs %.1f GFLOP (executed %.1f); MFU upper bound %.1f%% (step >= %.3f ms)\n",
                    c->model_flops / 1e9, total.flops / 1e9, 100 * c->MfuBound(), total.seconds * 1e3);
        row["model_flops"] = c->model_flops;
        row["mfu_upper_bound"] = c->MfuBound();
      } else {
        std::printf("  executed %.1f GFLOP; step >= %.3f ms; no MFU bound: spaco and sparse pages skip model work "
                    "by design\n", total.flops / 1e9, total.seconds * 1e3);
        row["model_flops"] = nullptr;
        row["mfu_upper_bound"] = nullptr;
      }
      out["rows"].push_back(row);
    }
  }
  if (!json_path.empty()) ExitIfError(WriteTextFile(ResolveUserPath(json_path), out.dump(2) + "\n"), "--json");
  return 0;
}

}  // namespace sg::tools
