#include "core/census.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "core/lora.h"
#include "core/mamba.h"
#include "core/objective.h"
#include "core/plan.h"
#include "core/transformer.h"

namespace sg {

int64_t ModelFlops(Model& model, int64_t seq_len) {
  const int64_t T = seq_len;
  if (auto* t = dynamic_cast<TransformerModel*>(&model)) {
    const TransformerConfig& c = t->config();
    const int64_t d = c.hidden_size, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
    const int64_t layer = d * qd + 2 * d * kvd + qd * d + 3 * d * c.intermediate_size;
    const int64_t matmul = c.num_layers * layer + c.vocab_size * d;
    const int64_t causal_pairs = T * (T + 1) / 2;
    return 6 * matmul * T + 3 * 4 * c.head_dim * c.num_heads * c.num_layers * causal_pairs;
  }
  if (auto* m = dynamic_cast<MambaModel*>(&model)) {
    const MambaConfig& c = m->config();
    const int64_t d = c.hidden_size, E = c.intermediate_size, R = c.time_step_rank, N = c.state_size;
    const int64_t layer = d * 2 * E + E * (R + 2 * N) + R * E + E * d;
    return 6 * (c.num_layers * layer + c.vocab_size * d) * T;
  }
  return 0;
}

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
