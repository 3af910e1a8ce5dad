#include "core/census.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "core/lora.h"
#include "core/models/family.h"
#include "core/objective.h"
#include "core/plan.h"

namespace sg {

int64_t ModelFlops(Model& model, int64_t seq_len) { return model.spec()->StepFlops(seq_len); }

absl::StatusOr<StepCensus> CensusOfStep(const std::string& spec, DType dtype, const StrategyOptions& strategy,
                                        int64_t seq_len, Device device, RooflineLimits limits, bool keep_records) {
  if (absl::Status s = ValidateStrategyOptions(strategy); !s.ok()) return s;
  StepCensus census;
  census.seq_len = seq_len;
  census.ops = OpCensus(limits, keep_records);
  CensusScope scope(device, &census.ops);  // before the model: it binds the (counting) op table when created
  absl::StatusOr<std::unique_ptr<Model>> model = CreatePlanModel(spec, dtype, device, LoraOptions{}, /*seed=*/1);
  if (!model.ok()) return model.status();
  if (absl::Status s = ValidateStrategyForModel(strategy, **model); !s.ok()) return s;
  census.ops.Clear();  // creating the model ran ops (norm weights filled with ones): not part of the step
  absl::StatusOr<MemoryPlan> step = PlanStep(**model, strategy, ObjectiveOptions{}, seq_len);
  if (!step.ok()) return step.status();
  if (strategy.name != "spaco" && strategy.sparse_pages == 0) census.model_flops = ModelFlops(**model, seq_len);
  return census;
}

}  // namespace sg
