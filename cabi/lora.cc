// LoRA on a model handle: enabling adapters, their options, saving and loading them (PEFT's format).
#include "core/lora.h"

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cabi/internal.h"
#include "core/lora_io.h"

namespace sg::cabi {
namespace {

// Under core.mu: LoRA changes the parameters, which the optimizer state of an existing trainer would not match.
sg_status* CheckLoraCanBeEnabled(const char* fn, const ModelCore& core) {
  if (core.model->lora())
    return MakeStatus(SG_ERR_FAILED_PRECONDITION, absl::StrCat(fn, ": LoRA is already enabled on this model"));
  if (core.trainers > 0)
    return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                      absl::StrCat(fn, ": the model has ", core.trainers, core.trainers == 1 ? " trainer" : " trainers",
                                   "; enable LoRA before creating trainers (their optimizer state would not match "
                                   "the adapters)"));
  return nullptr;
}

// options, checked, into the engine's; the targets default to the family's (as cli:train's --lora_targets).
sg_status* LoraOptionsOf(const char* fn, const sg_lora_options& options, const Model& m, LoraOptions* o) {
  if (options.rank < 1) return Invalid(absl::StrCat(fn, ": options->rank is ", options.rank, "; need >= 1"));
  const double alpha = options.alpha == 0 ? 2.0 * static_cast<double>(options.rank) : options.alpha;
  if (!(alpha > 0 && std::isfinite(alpha)))
    return Invalid(absl::StrCat(fn, ": options->alpha is ", options.alpha, "; need a finite value > 0 (0 = 2 * rank)"));
  if (!(options.dropout >= 0 && options.dropout < 1))
    return Invalid(absl::StrCat(fn, ": options->dropout is ", options.dropout, "; need [0, 1)"));
  const LoraKind kind = LoraKind::Of(m);
  const std::string targets = options.targets ? options.targets : DefaultLoraTargets(kind);
  absl::StatusOr<std::vector<std::string>> parsed = ParseLoraTargets(targets, kind);
  if (!parsed.ok()) return Invalid(absl::StrCat(fn, ": ", FieldMessage(parsed.status().message())));
  o->rank = options.rank;
  o->alpha = alpha;
  o->dropout = options.dropout;
  o->targets = *parsed;
  o->seed = options.seed;
  return nullptr;
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_lora_options sg_lora_default_options(void) {
  sg_lora_options o{};
  o.struct_size = sizeof(sg_lora_options);
  o.rank = 8;
  o.alpha = 0;  // 2 * rank
  o.dropout = 0;
  o.targets = nullptr;  // the family's default
  o.seed = 0;
  return o;
}

sg_status* sg_model_enable_lora(sg_model* model, const sg_lora_options* options) {
  static const char fn[] = "sg_model_enable_lora";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!options) return NullArg(fn, "options");
    if (sg_status* s = CheckStructSize(fn, "options", options->struct_size, sizeof(sg_lora_options))) return s;
    sg::Model& m = *model->core->model;
    sg::LoraOptions o;
    if (sg_status* s = LoraOptionsOf(fn, *options, m, &o)) return s;
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    std::lock_guard<std::mutex> lock(model->core->mu);
    if (sg_status* s = CheckLoraCanBeEnabled(fn, *model->core)) return s;
    if (absl::Status s = sg::EnableLora(m, o); !s.ok()) return FromAbslIn(fn, s);
    model->core->lora_targets = absl::StrJoin(m.lora()->options.targets, ",");
    return nullptr;
  });
}

sg_status* sg_model_lora(const sg_model* model, sg_lora_options* out) {
  static const char fn[] = "sg_model_lora";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!out) return NullArg(fn, "out");
    if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_lora_options))) return s;
    const sg::LoraInfo* lora = model->core->model->lora();
    out->rank = lora ? lora->options.rank : 0;
    out->alpha = lora ? lora->options.alpha : 0;
    out->dropout = lora ? lora->options.dropout : 0;
    out->targets = lora ? model->core->lora_targets.c_str() : nullptr;
    out->seed = lora ? lora->options.seed : 0;
    return nullptr;
  });
}

sg_status* sg_model_save_lora_adapter(sg_model* model, const char* dir, const char* base_model_name_or_path) {
  static const char fn[] = "sg_model_save_lora_adapter";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbslIn(
        fn, sg::SaveLoraAdapter(*model->core->model, dir, base_model_name_or_path ? base_model_name_or_path : ""));
  });
}

sg_status* sg_model_load_lora_adapter(sg_model* model, const char* dir) {
  static const char fn[] = "sg_model_load_lora_adapter";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    if (sg_status* s = CheckDirectory(fn, "dir", dir)) return s;
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    std::lock_guard<std::mutex> lock(model->core->mu);
    sg::Model& m = *model->core->model;
    if (!m.lora())  // enables LoRA with the adapter's options
      if (sg_status* s = CheckLoraCanBeEnabled(fn, *model->core)) return s;
    if (absl::Status s = sg::LoadLoraAdapter(m, dir); !s.ok()) return FromAbslIn(fn, s);
    model->core->lora_targets = absl::StrJoin(m.lora()->options.targets, ",");
    return nullptr;
  });
}

}  // extern "C"
