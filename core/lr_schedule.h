// Learning-rate schedules: linear warmup, then constant, cosine or linear decay to a floor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/optimizer.h"

namespace sg {

// The known schedule names: constant, cosine, linear.
std::vector<std::string> LrScheduleNames();

// The checks ValidateOptimizerOptions makes on the schedule fields.
absl::Status ValidateLrSchedule(const OptimizerOptions& o);

// Learning rate of optimizer step `step` (1-based), W = warmup_steps, S = total_steps:
//   step <= W:  lr * step / W                               (linear warmup, never 0)
//   constant:   lr
//   cosine:     min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,  p = min(1, (step - W) / (S - W))
//   linear:     lr - (lr - min_lr) * p
// Past S the decaying schedules stay at min_lr.
double ScheduledLr(const OptimizerOptions& o, int64_t step);

}  // namespace sg
