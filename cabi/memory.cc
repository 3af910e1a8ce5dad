// Memory: the categories the engine counts, a model's memory limit, and the optimizer's share of it.
#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {

sg_status* CheckOptimizerMemory(const char* fn, sg_trainer* t) {
  Model& model = t->trainer->model();
  const int64_t limit = model.memory().limit();
  if (limit <= 0 || t->trainer->step() > 0) return nullptr;
  int64_t need = 0;
  for (const Param& p : model.params())
    if (p.grad.defined()) need += 2 * static_cast<int64_t>(p.value.nbytes());
  const int64_t in_use = model.memory().Snapshot().total_current;
  if (in_use + need <= limit) return nullptr;
  return MakeStatus(SG_ERR_RESOURCE_EXHAUSTED,
                    absl::StrCat(fn, ": memory limit of ", limit, " bytes exceeded: the optimizer's moments need ",
                                 need, " bytes with ", in_use, " in use"));
}

}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

const char* sg_memory_category_name(int category) {
  static_assert(SG_NUM_MEMORY_CATEGORIES_ALL == sg::kNumMemCategories, "category count changed: extend the C API");
  static_assert(SG_MEMORY_CATEGORY_MASTER_WEIGHTS == static_cast<int>(sg::MemCategory::kMasterWeights));
  if (category < 0 || category >= SG_NUM_MEMORY_CATEGORIES_ALL) return nullptr;
  return sg::MemCategoryName(static_cast<sg::MemCategory>(category));
}

sg_status* sg_model_set_memory_limit(sg_model* model, int64_t bytes) {
  static const char fn[] = "sg_model_set_memory_limit";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (bytes < 0) return Invalid(absl::StrCat(fn, ": argument 'bytes' is ", bytes, "; need >= 0 (0 = no limit)"));
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    model->core->model->memory().set_limit(bytes);
    return nullptr;
  });
}

int64_t sg_model_memory_limit(const sg_model* model) { return model ? model->core->model->memory().limit() : -1; }

}  // extern "C"
