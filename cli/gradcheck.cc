// Compares a strategy's gradients with full backprop on a model (preset or HF directory), in f64 by default.
// Prints and writes {"strategy", "max_rel_err", "max_abs_err", "params_checked", "samples", "mean_rel_err", ...}.
// With --lora_rank (or --lora_init) only the adapters are trainable, so only their gradients are checked; fresh
// adapters get a random B (PEFT's zero B would make every gradient of A zero).
#include <cstdio>
#include <string>
#include <vector>
#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/gradcheck.h"
#include "core/lora.h"
#include "core/model_io.h"
#include "distributed/mpi_plugin.h"
#include "distributed/tensor_parallel.h"
#include "cli/common.h"

ABSL_FLAG(std::string, json, "", "write the result here");
ABSL_FLAG(int, tp, 1,
          "under mpirun (tp ranks): the strategy's gradient of the model split over the ranks (docs/distributed.md), "
          "gathered, against one process's gradient of the same strategy");
ABSL_FLAG(int64_t, samples, 1, "average the strategy's gradient over this many calls (spaco: independent samples)");
ABSL_FLAG(std::string, adjoint_windows, "",
          "adjoint: comma-separated truncation windows T̄ (or none) to sweep; prints the gradient error against "
          "exact and the vector-Jacobian products per layer and channel for each");
ABSL_FLAG(std::string, sparse_sweep, "",
          "comma-separated --sparse_pages budgets (seco): one row each, the loss and gradient deviation of the "
          "sparse model from dense full backprop");
ABSL_FLAG(int64_t, seq_len, 61,
          "length of the longest test sequence (sft: a second of a third of it makes the batch ragged; dpo/grpo: "
          "prompt + response, see MakeCheckBatch in core/gradcheck.h)");

namespace sg {
namespace {

// --tp: per strategy, the split model's gradient (gathered) against the whole model's, both by the strategy.
int TensorParallelCheck(Model& whole, const Batch& batch, const std::vector<StrategyOptions>& runs,
                        const ObjectiveOptions& objective, int tp) {
  absl::StatusOr<std::unique_ptr<dist::Communicator>> world = dist::JoinMpiJob("--tp");
  tools::ExitIfError(world.status(), "--tp");
  absl::StatusOr<dist::TensorParallelGrid> grid = dist::CreateTensorParallelGrid(**world, tp);
  tools::ExitIfError(grid.status(), "--tp");
  absl::StatusOr<std::unique_ptr<Model>> split = dist::SplitModel(whole, grid->layers());
  tools::ExitIfError(split.status(), "--tp");
  Trainer shape(**split, runs[0], OptimizerOptions{}, objective);
  absl::StatusOr<dist::WholeTrainer> gathered = dist::MakeWholeTrainer(shape, Device::kCPU);  // to gather into
  tools::ExitIfError(gathered.status(), "--tp");
  if ((*world)->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 1;  // rank 0 prints
  for (const StrategyOptions& run : runs) {
    Trainer one(whole, run, OptimizerOptions{}, objective), parted(**split, run, OptimizerOptions{}, objective);
    absl::StatusOr<StepMetrics> want = one.ComputeGradients(batch), got = parted.ComputeGradients(batch);
    tools::ExitIfError(want.status(), "gradcheck");
    tools::ExitIfError(got.status(), "--tp");
    tools::ExitIfError(GatherGrads(**split, *gathered->model), "--tp");
    double worst = 0;  // max |difference| / max |one process's| per parameter, the worst parameter
    std::string worst_param;
    for (size_t i = 0; i < whole.params().size(); ++i) {
      const Tensor& a = whole.params()[i].grad;
      const Tensor& b = gathered->model->params()[i].grad;
      if (!a.defined()) continue;
      double diff = 0, scale = 0;
      for (int64_t k = 0; k < a.numel(); ++k) {
        const double x = a.dtype() == DType::kF64 ? a.data<double>()[k] : a.data<float>()[k];
        const double y = b.dtype() == DType::kF64 ? b.data<double>()[k] : b.data<float>()[k];
        diff = std::max(diff, std::abs(x - y));
        scale = std::max(scale, std::abs(x));
      }
      if (scale > 0 && diff / scale > worst) worst = diff / scale, worst_param = whole.params()[i].name;
    }
    std::printf("{\"model\": \"%s\", \"strategy\": \"%s\", \"objective\": \"%s\", \"tp\": %d, "
                "\"loss\": %.17g, \"one_process_loss\": %.17g, \"max_rel_err\": %.3e, \"worst_param\": \"%s\"}\n",
                absl::GetFlag(FLAGS_model).c_str(), run.name.c_str(), objective.name.c_str(), tp, got->loss,
                want->loss, worst, worst_param.c_str());
  }
  return 0;
}

int Main() {
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  if (*dtype == DType::kBF16)
    tools::ExitIfError(absl::InvalidArgumentError("--dtype=bf16: gradcheck compares gradients in f64 or f32"),
                       "flags");
  const Device device = tools::DeviceFromFlags();
  const StrategyOptions strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(strategy), "flags");
  const int64_t seq_len = absl::GetFlag(FLAGS_seq_len);
  if (seq_len <= 0) tools::ExitIfError(absl::InvalidArgumentError("--seq_len must be positive"), "flags");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<std::unique_ptr<Model>> model =
      LoadAnyModel(tools::ModelSpec(), *dtype, seed, device, tools::LoraRequested());
  tools::ExitIfError(model.status(), "--model");
  const std::string lora = tools::ApplyLoraFlags(**model);
  if (!lora.empty() && absl::GetFlag(FLAGS_lora_init).empty()) RandomizeLoraB(**model, seed + 1, 0.3);
  if (!lora.empty()) std::fprintf(stderr, "%s\n", lora.c_str());

  const ObjectiveOptions objective = tools::ObjectiveFromFlags();
  tools::ExitIfError(ValidateObjectiveOptions(objective), "flags");
  absl::StatusOr<Batch> batch = MakeCheckBatch(**model, objective, seq_len, seed);
  tools::ExitIfError(batch.status(), "gradcheck batch");

  std::vector<StrategyOptions> runs = {strategy};
  if (const std::string list = absl::GetFlag(FLAGS_adjoint_windows); !list.empty()) {
    if (strategy.name != "adjoint")
      tools::ExitIfError(absl::InvalidArgumentError("--adjoint_windows needs --strategy=adjoint"), "flags");
    runs.clear();
    for (absl::string_view w : absl::StrSplit(list, ',')) {
      absl::StatusOr<int64_t> window = tools::ParseAdjointWindow(std::string(w));
      tools::ExitIfError(window.status(), "--adjoint_windows");
      runs.push_back(strategy);
      runs.back().adjoint_window = *window;
      tools::ExitIfError(ValidateStrategyOptions(runs.back()), "--adjoint_windows");
    }
  }
  if (const std::string list = absl::GetFlag(FLAGS_sparse_sweep); !list.empty()) {
    if (!absl::GetFlag(FLAGS_adjoint_windows).empty())
      tools::ExitIfError(absl::InvalidArgumentError("--sparse_sweep and --adjoint_windows exclude each other"), "flags");
    runs.clear();
    for (absl::string_view k : absl::StrSplit(list, ',')) {
      runs.push_back(strategy);
      if (!absl::SimpleAtoi(k, &runs.back().sparse_pages))
        tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("--sparse_sweep: '", k, "' is not a number")),
                           "flags");
      tools::ExitIfError(ValidateStrategyOptions(runs.back()), "--sparse_sweep");
    }
  }
  if (const int tp = absl::GetFlag(FLAGS_tp); tp != 1) return TensorParallelCheck(**model, *batch, runs, objective, tp);
  const int64_t layers = (*model)->num_layers();
  std::vector<std::string> rows;
  for (const StrategyOptions& run : runs) {
    absl::StatusOr<GradCheckResult> r = CheckAgainstFull(**model, *batch, run, objective, absl::GetFlag(FLAGS_samples));
    tools::ExitIfError(r.status(), "gradcheck");
    const std::string window =
        run.adjoint_window == StrategyOptions::kNoAdjointWindow ? "null" : absl::StrCat(run.adjoint_window);
    rows.push_back(absl::StrFormat(
        "{\"model\": \"%s\", \"strategy\": \"%s\", \"objective\": \"%s\", \"dtype\": \"%s\", \"chunk\": %d, "
        "\"seq_len\": %d, \"max_rel_err\": %.3e, \"max_abs_err\": %.3e, \"params_checked\": %d, "
        "\"worst_param\": \"%s\", \"loss\": %.17g, \"reference_loss\": %.17g, \"samples\": %d, "
        "\"mean_rel_err\": %.6e, \"spaco_budget\": %d, \"spaco_cap\": %g, \"adjoint_form\": \"%s\", "
        "\"adjoint_window\": %s, \"adjoint_pairs_per_layer\": %d, \"sparse_pages\": %d, \"lora\": %s}",
        absl::GetFlag(FLAGS_model), run.name, objective.name, absl::GetFlag(FLAGS_dtype), run.chunk, seq_len,
        r->max_rel_err, r->max_abs_err, r->params_checked, r->worst_param, r->loss, r->reference_loss, r->samples,
        r->mean_rel_err, run.spaco_budget, run.spaco_cap, run.adjoint_form, window, r->adjoint_pairs / layers,
        run.sparse_pages, tools::LoraJson(**model)));
    std::printf("%s\n", rows.back().c_str());
  }
  const std::string json = rows.size() == 1 ? rows[0] : absl::StrCat("[", absl::StrJoin(rows, ",\n "), "]");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty())
    tools::ExitIfError(tools::WriteTextFile(tools::ResolveUserPath(path), json + "\n"), "--json");
  return 0;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  sg::tools::InitTool(argc, argv, "Compare a strategy's gradients with full backprop.");
  return sg::tools::RunTool("gradcheck", sg::Main);
}
