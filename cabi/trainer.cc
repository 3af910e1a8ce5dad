// The trainer handle: its options, creation (joining a tensor-parallel job when asked), reference model, progress
// callback and cancellation.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"
#include "cabi/trainer_options.h"
#include "core/strategy.h"

namespace sg::cabi {
namespace {

// The engine column of the options that are converted here by hand (cabi/trainer_options.inc).
struct ByHand;

// An option as the engine holds it: a NULL string is the option's default, an int32_t flag a bool.
void CopyOption(const char* value, const char* default_value, std::string* to) { *to = value ? value : default_value; }
template <typename From, typename Default, typename To>
void CopyOption(From value, Default, To* to) {
  *to = static_cast<To>(value);
}

// Copies the options that cabi/trainer_options.inc gives the engine struct Engine (StrategyOptions, ...) as they are.
// Older callers' options keep the engine's defaults of the fields their struct_size does not reach.
template <typename Engine>
void CopyPlainOptions(const sg_trainer_options& o, Engine* to) {
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc)                                                      \
  if constexpr (std::is_same_v<Engine, engine>) {                                                                 \
    if (o.struct_size >= offsetof(sg_trainer_options, name) + sizeof(o.name)) CopyOption(o.name, def, &to->name); \
  }
#include "cabi/trainer_options.inc"
}

sg_status* CheckOptionsSize(const char* fn, const sg_trainer_options& o) {
  if (sg_status* s = CheckStructSize(fn, "options", o.struct_size, sizeof(sg_trainer_options), kTrainerOptionsSizes))
    return s;
  for (uint64_t r : o.reserved)
    if (r != 0) return Invalid(absl::StrCat(fn, ": options->reserved must be zero"));
  return nullptr;
}

// Older callers' options keep the defaults of the fields they lack.
StrategyOptions StrategyOptionsOf(const sg_trainer_options& o) {
  StrategyOptions so;
  so.name = o.strategy ? o.strategy : "full";
  CopyPlainOptions(o, &so);
  return so;
}

sg_status* NumThreadsOf(const char* fn, const sg_trainer_options& o, int* num_threads) {
  // 0.6 callers' reserved_0_6 was zero: the default.
  *num_threads = o.struct_size > kTrainerOptionsSize0_5 ? o.num_threads : 0;
  if (*num_threads < 0 || *num_threads > SG_MAX_THREADS)
    return Invalid(absl::StrCat(fn, ": options->num_threads is ", *num_threads, "; need 0 .. ", SG_MAX_THREADS,
                                " (0 = the calling thread's OpenMP default)"));
  return nullptr;
}

// options->tp, 1 (no tensor parallelism) for 0 and for callers built before the field.
int64_t RequestedTp(const sg_trainer_options& o) {
  return o.struct_size > kTrainerOptionsSize0_6 && o.tp != 0 ? o.tp : 1;
}

// Checked whatever the strategy (the core checks the adjoint fields for "adjoint" only): a bad value is never
// silently kept.
sg_status* CheckStrategy(const char* fn, const StrategyOptions& so, const Model& model) {
  if (absl::StatusOr<StrategyFn> f = FindStrategy(so.name); !f.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(f.status().message())));
  if (so.adjoint_form != "pairs" && so.adjoint_form != "scan" && so.adjoint_form != "paper")
    return Invalid(
        absl::StrCat(fn, ": options->adjoint_form is '", so.adjoint_form, "'; known forms: pairs, scan, paper"));
  if (so.adjoint_window <= 0)
    return Invalid(absl::StrCat(fn, ": options->adjoint_window is ", so.adjoint_window,
                                "; need a positive number of tokens (INT64_MAX = no window)"));
  if (absl::Status s = ValidateStrategyOptions(so); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  if (absl::Status s = ValidateStrategyForModel(so, model); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  return nullptr;
}

sg_status* ObjectiveOptionsOf(const char* fn, const sg_trainer_options& o, ObjectiveOptions* obj) {
  if (o.struct_size > kTrainerOptionsSize0_2) obj->name = o.objective ? o.objective : "sft";  // older: sft
  CopyPlainOptions(o, obj);
  // Callers built before the field keep the plain k3 they were built for.
  obj->grpo_kl_bias_correction = o.struct_size > kTrainerOptionsSize0_7 && o.grpo_kl_bias_correction;
  if (obj->name != "sft" && obj->name != "dpo" && obj->name != "grpo")
    return Invalid(absl::StrCat(fn, ": options->objective is '", obj->name, "'; known objectives: sft, dpo, grpo"));
  if (!(obj->dpo_beta > 0 && std::isfinite(obj->dpo_beta)))
    return Invalid(absl::StrCat(fn, ": options->dpo_beta is ", obj->dpo_beta, "; need a finite value > 0"));
  if (!(obj->grpo_clip_eps > 0 && obj->grpo_clip_eps < 1))
    return Invalid(absl::StrCat(fn, ": options->grpo_clip_eps is ", obj->grpo_clip_eps, "; need (0, 1)"));
  if (!(obj->grpo_kl_beta >= 0 && std::isfinite(obj->grpo_kl_beta)))
    return Invalid(absl::StrCat(fn, ": options->grpo_kl_beta is ", obj->grpo_kl_beta, "; need a finite value >= 0"));
  if (absl::Status s = ValidateObjectiveOptions(*obj); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  return nullptr;
}

sg_status* OptimizerOptionsOf(const char* fn, const sg_trainer_options& o, OptimizerOptions* oo) {
  auto positive = [](double v) { return v > 0 && v < 1e300; };
  if (!positive(o.lr)) return Invalid(absl::StrCat(fn, ": options->lr is ", o.lr, "; need > 0"));
  if (!(o.beta1 >= 0 && o.beta1 < 1))
    return Invalid(absl::StrCat(fn, ": options->beta1 is ", o.beta1, "; need [0, 1)"));
  if (!(o.beta2 >= 0 && o.beta2 < 1))
    return Invalid(absl::StrCat(fn, ": options->beta2 is ", o.beta2, "; need [0, 1)"));
  if (!positive(o.eps)) return Invalid(absl::StrCat(fn, ": options->eps is ", o.eps, "; need > 0"));
  if (!(o.weight_decay >= 0))
    return Invalid(absl::StrCat(fn, ": options->weight_decay is ", o.weight_decay, "; need >= 0"));
  if (!(o.clip_grad_norm >= 0))
    return Invalid(absl::StrCat(fn, ": options->clip_grad_norm is ", o.clip_grad_norm, "; need >= 0"));
  CopyPlainOptions(o, oo);
  if (absl::Status s = ValidateOptimizerOptions(*oo); !s.ok())
    return Invalid(absl::StrCat(fn, ": options->", s.message()));
  return nullptr;
}

// Collective over the MPI job: every rank gets here, also with a local error, so that all learn of it at once.
sg_status* JoinJob(const char* fn, sg_trainer& t, int64_t tp) {
  absl::Status local;
  if (t.core->tp_group)
    local = absl::FailedPreconditionError("--tp: the model already has a tensor-parallel trainer (one per model)");
  absl::StatusOr<std::unique_ptr<dist::TensorParallelRun>> run =
      JoinTensorParallel(*t.core->model, static_cast<int>(tp), local);
  if (!run.ok()) return FromAbslIn(fn, run.status());
  t.tp = std::move(*run);
  return nullptr;
}

// sg_trainer_create's body; *joined tells whether it reached the tensor-parallel job.
sg_status* CreateTrainer(const char* fn, sg_model* model, const sg_trainer_options* options, sg_trainer** out,
                         bool* joined) {
  if (!out) return NullArg(fn, "out");
  *out = nullptr;
  if (!model) return NullArg(fn, "model");
  if (!options) return NullArg(fn, "options");
  if (sg_status* s = CheckOptionsSize(fn, *options)) return s;
  const StrategyOptions so = StrategyOptionsOf(*options);
  int num_threads = 0;
  if (sg_status* s = NumThreadsOf(fn, *options, &num_threads)) return s;
  const int64_t tp = RequestedTp(*options);
  if (tp < 1 || tp > INT32_MAX)
    return Invalid(absl::StrCat(fn, ": options->tp is ", tp, "; need >= 1 (0 or 1 = no tensor parallelism)"));
  if (sg_status* s = CheckStrategy(fn, so, *model->core->model)) return s;
  ObjectiveOptions obj;
  if (sg_status* s = ObjectiveOptionsOf(fn, *options, &obj)) return s;
  OptimizerOptions oo;
  if (sg_status* s = OptimizerOptionsOf(fn, *options, &oo)) return s;
  auto t = std::make_unique<sg_trainer>();
  t->core = model->core;
  t->objective = obj;
  std::lock_guard<std::mutex> lock(t->core->mu);  // LoRA is not enabled while a trainer is being created
  if (tp > 1) {
    *joined = true;
    if (sg_status* s = JoinJob(fn, *t, tp)) return s;
  }
  Model& trained = t->tp ? *t->tp->split : *t->core->model;
  t->trainer = std::make_unique<Trainer>(trained, so, oo, obj);
  t->trainer->set_cancel_flag(&t->cancel);
  t->trainer->set_num_threads(num_threads);
  if (t->tp) {
    if (absl::Status s = dist::CheckSameRun(*t->tp, *t->trainer); !s.ok()) {
      t->trainer.reset();  // not counted among the model's trainers
      return FromAbslIn(fn, s);
    }
    t->core->tp_group = t->tp->world.get();  // the job's rank 0 writes (every group holds the same model)
  }
  ++t->core->trainers;
  *out = t.release();
  return nullptr;
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_trainer_options sg_trainer_default_options(void) {
  sg_trainer_options o{};
  o.struct_size = sizeof(sg_trainer_options);
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) o.name = def;
#include "cabi/trainer_options.inc"
  static_assert(sg::StrategyOptions::kNoAdjointWindow == INT64_MAX, "the C API documents INT64_MAX as no window");
  return o;
}

sg_status* sg_trainer_create(sg_model* model, const sg_trainer_options* options, sg_trainer** out) {
  static const char fn[] = "sg_trainer_create";
  return Guard(fn, [&]() -> sg_status* {
    bool joined = false;
    sg_status* s = CreateTrainer(fn, model, options, out, &joined);
    // A rank whose own options failed still joins a tensor-parallel job, so that the others learn of it at once.
    const int64_t tp = options ? RequestedTp(*options) : 1;
    if (s && !joined && model && tp > 1 && tp <= INT32_MAX)
      (void)JoinTensorParallel(*model->core->model, static_cast<int>(tp), absl::AbortedError("failed"));
    return s;
  });
}

void sg_trainer_free(sg_trainer* trainer) { delete trainer; }

int64_t sg_trainer_step_count(const sg_trainer* trainer) { return trainer ? trainer->trainer->step() : -1; }

sg_status* sg_trainer_set_reference(sg_trainer* trainer, sg_model* reference) {
  static const char fn[] = "sg_trainer_set_reference";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (reference) {
      if (reference->core == trainer->core)
        return Invalid(absl::StrCat(fn,
                                    ": argument 'reference' is the trainer's own model; a reference must stay "
                                    "frozen: load or create the same weights again as another model"));
      const int64_t got = reference->core->model->vocab_size(), want = trainer->core->model->vocab_size();
      if (got != want)
        return Invalid(absl::StrCat(fn, ": argument 'reference' has a vocabulary of ", got,
                                    " tokens; the trainer's model has ", want));
    }
    trainer->reference = reference ? reference->core : nullptr;
    trainer->trainer->set_reference(reference ? reference->core->model.get() : nullptr);
    return nullptr;
  });
}

sg_status* sg_trainer_set_reference_base_model(sg_trainer* trainer) {
  static const char fn[] = "sg_trainer_set_reference_base_model";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (!trainer->core->model->lora())
      return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                        absl::StrCat(fn,
                                     ": the trainer's model has no LoRA adapters (sg_model_enable_lora), so "
                                     "without them it would be the policy itself"));
    trainer->reference = nullptr;
    trainer->trainer->set_reference_base_model();
    return nullptr;
  });
}

void sg_trainer_cancel(sg_trainer* trainer) {
  if (trainer) trainer->cancel.store(true, std::memory_order_relaxed);
}

sg_status* sg_trainer_set_progress_callback(sg_trainer* trainer, sg_progress_fn fn_ptr, void* user) {
  static const char fn[] = "sg_trainer_set_progress_callback";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    trainer->progress = fn_ptr;
    trainer->progress_user = user;
    return nullptr;
  });
}

}  // extern "C"
