// The optimizer: AdamW with decoupled weight decay over every parameter that has a gradient, gradient clipping by
// global norm, and the learning-rate schedule (core/lr_schedule.h).
//
// Master weights: with f32 or f64 weights, the parameters the optimizer updates are themselves full precision and no
// separate copy exists. With bf16 storage every trainable parameter stored in bf16 gets an fp32 master copy, counted
// in the master_weights memory category (the fp32 moments are optimizer): the step runs on the master and rounds it
// into the bf16 weight. Frozen bf16 weights (LoRA's base) have no master and no fp32 copy at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model.h"

namespace sg {

struct OptimizerOptions {
  double lr = 1e-3;  // peak learning rate (after warmup)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;    // decoupled (AdamW); matrices only, norms and biases are not decayed
  double clip_grad_norm = 1.0;  // 0 = no clipping
  // Learning-rate schedule (core/lr_schedule.h): linear warmup from lr / warmup_steps to lr over warmup_steps
  // steps, then "constant" (lr), "cosine" or "linear" decay from lr to min_lr at step total_steps.
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  int64_t total_steps = 0;  // the decay's horizon; needed (> warmup_steps) by cosine and linear
  // Micro-batches per optimizer step (gradient accumulation). The Trainer's Step(std::vector<Batch>) and
  // AccumulateGradients take micro-batches one at a time; tools draw this many per step.
  int64_t grad_accum = 1;
};

// Every field's range; the message names the field and the value.
absl::Status ValidateOptimizerOptions(const OptimizerOptions& o);

// Squared global L2 norm of every defined gradient. A gradient holding NaN or Inf is an error naming the parameter,
// the first bad element and `when` (e.g. "at step 3").
absl::StatusOr<double> GradSquaredNorm(Model& model, const std::string& when);
// "" when every parameter value is finite, otherwise "; parameter 'NAME' holds VALUE at element I" for the first
// one that does not (appended to non-finite loss errors).
std::string NonFiniteWeightsNote(Model& model);
// Multiplies every defined gradient by factor.
void ScaleGrads(Model& model, double factor);

// AdamW state: first and second moments per parameter (allocated on the first step, all or none, in the
// optimizer memory category) and the number of steps taken (bias correction).
class AdamW {
 public:
  // One update of every parameter with a gradient at learning rate lr.
  absl::Status Step(Model& model, const OptimizerOptions& o, double lr);

  int64_t step() const { return step_; }
  bool has_moments() const { return !m_.empty(); }
  // Per parameter (model.params() order); undefined tensors for parameters without a gradient.
  const std::vector<Tensor>& m() const { return m_; }
  const std::vector<Tensor>& v() const { return v_; }
  // Per parameter: the fp32 master of a trainable bf16 parameter, undefined otherwise.
  const std::vector<Tensor>& master() const { return master_; }
  // Bytes the moments and masters take (or will take once allocated) for `model`.
  static int64_t StateBytes(Model& model);
  // Allocates zero moments (and masters from the bf16 weights) if there are none (a memory limit error leaves the
  // state as it was).
  absl::Status EnsureMoments(Model& model);
  // Checkpoint restore: EnsureMoments, then write into the moments' storage and set the step.
  std::vector<Tensor>& mutable_m() { return m_; }
  std::vector<Tensor>& mutable_v() { return v_; }
  std::vector<Tensor>& mutable_master() { return master_; }
  // Sets every master to its bf16 weight (after the weights were replaced without optimizer state).
  void RefreshMasters(Model& model);
  void set_step(int64_t step) { step_ = step; }

 private:
  std::vector<Tensor> master_, m_, v_;
  int64_t step_ = 0;
};

}  // namespace sg
