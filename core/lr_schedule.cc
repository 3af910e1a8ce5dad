#include "core/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace sg {

std::vector<std::string> LrScheduleNames() { return {"constant", "cosine", "linear"}; }

absl::Status ValidateLrSchedule(const OptimizerOptions& o) {
  const std::vector<std::string> names = LrScheduleNames();
  if (std::find(names.begin(), names.end(), o.lr_schedule) == names.end())
    return absl::InvalidArgumentError(
        absl::StrCat("lr_schedule '", o.lr_schedule, "' is not known; known schedules: ", absl::StrJoin(names, ", ")));
  if (o.warmup_steps < 0)
    return absl::InvalidArgumentError(absl::StrCat("warmup_steps is ", o.warmup_steps, "; need >= 0"));
  if (!(o.min_lr >= 0 && o.min_lr <= o.lr))
    return absl::InvalidArgumentError(absl::StrCat("min_lr is ", o.min_lr, "; need 0 <= min_lr <= lr (", o.lr, ")"));
  if (o.lr_schedule != "constant" && o.total_steps <= o.warmup_steps)
    return absl::InvalidArgumentError(absl::StrCat("lr_schedule '", o.lr_schedule, "' decays from warmup_steps (",
                                                   o.warmup_steps, ") to total_steps (", o.total_steps,
                                                   "): total_steps must be larger"));
  return absl::OkStatus();
}

double ScheduledLr(const OptimizerOptions& o, int64_t step) {
  if (step <= o.warmup_steps) return o.lr * static_cast<double>(std::max<int64_t>(step, 1)) / o.warmup_steps;
  if (o.lr_schedule == "constant" || o.total_steps <= o.warmup_steps) return o.lr;
  const double p =
      std::min(1.0, static_cast<double>(step - o.warmup_steps) / static_cast<double>(o.total_steps - o.warmup_steps));
  if (o.lr_schedule == "cosine") return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + std::cos(M_PI * p));
  return o.lr - (o.lr - o.min_lr) * p;
}

}  // namespace sg
