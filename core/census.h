// The roofline census of one training step (kernels/census.h): the step PlanStep walks (core/plan.h: Trainer::Step
// with AdamW on a synthetic sft sequence) with a counting decorator over the device's op table, so that the
// FLOPs and bytes of every kernel family, and the step's time at a device's limits, are known without a GPU. On
// the meta device nothing executes (any model at any length, in seconds); on the CPU the same step executes and
// gives the same records. A model of the CUDA backend's work, not a measurement.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "core/model.h"
#include "core/strategy.h"
#include "kernels/census.h"

namespace sg {

struct StepCensus {
  int64_t seq_len = 0;
  OpCensus ops;
  // The step's model FLOPs, the numerator of MFU: 6 x (matmul parameters) x tokens, plus for transformers
  // 3 x the causal attention forward (4 x head_dim x heads x layers per (query, key) pair); recomputation and the
  // kernels' extra products are not model FLOPs. 0 (undefined) for steps that skip model work by design: spaco
  // (backprops sampled chunks) and sparse page attention.
  int64_t model_flops = 0;
  double Seconds() const { return ops.Total().seconds; }
  // The highest MFU the step can reach at these limits: model FLOPs / (peak FLOP/s x the sum of roofline times);
  // 0 when model_flops is.
  double MfuBound() const {
    return model_flops > 0 ? static_cast<double>(model_flops) / (ops.limits().peak_flops * Seconds()) : 0;
  }
};

// Model FLOPs of one sft step over a sequence of seq_len tokens (see StepCensus::model_flops).
int64_t ModelFlops(Model& model, int64_t seq_len);

// The census of one training step of model `spec` (a preset, HF directory or config.json; core/plan.h's
// CreatePlanModel) in `dtype` (bf16: bf16 storage) under `strategy` at seq_len tokens, counted on `device`
// (kMeta: nothing executes; kCPU: the step runs). keep_records keeps every op's record (tests).
absl::StatusOr<StepCensus> CensusOfStep(const std::string& spec, DType dtype, const StrategyOptions& strategy,
                                        int64_t seq_len, Device device = Device::kMeta, RooflineLimits limits = {},
                                        bool keep_records = false);

}  // namespace sg
