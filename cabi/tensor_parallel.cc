// Tensor parallelism behind the C ABI (sg_trainer_options.tp): a trainer joins the MPI job, trains this rank's
// blocks of the handle's (whole) model, and keeps the handle showing the whole model, so that views, saves and
// checkpoints are those of one process (docs/design.md "Parallelism"). The engine side is sg::dist's; here the job
// is joined through the MPI plug-in and the handles' calls agree across ranks.
#include "absl/strings/str_cat.h"
#include "cabi/internal.h"
#include "distributed/mpi_plugin.h"

namespace sg::cabi {

absl::StatusOr<std::unique_ptr<dist::TensorParallelRun>> JoinTensorParallel(Model& whole, int tp,
                                                                            const absl::Status& precheck) {
  absl::StatusOr<std::unique_ptr<dist::Communicator>> world = dist::JoinMpiJob("--tp");
  if (!world.ok()) return world.status();
  return dist::JoinTensorParallel(std::move(*world), whole, tp, precheck);
}

absl::Status TakeHandleValues(sg_trainer* t) {
  if (!t->tp) return absl::OkStatus();
  return t->tp->ScatterFrom(*t->core->model);
}

absl::Status ShowWholeModel(sg_trainer* t, bool grads, bool values) {
  if (!t->tp) return absl::OkStatus();
  return t->tp->GatherInto(*t->core->model, grads, values);
}

int64_t TpBytes(const sg_trainer* t) { return t->tp ? t->tp->bytes_communicated() : 0; }

sg_status* Agree(const char* fn, sg_trainer* t, sg_status* local) {
  if (!t->tp || t->agreed) return local;
  t->agreed = true;
  const absl::Status all =
      dist::AgreeAcrossRanks(*t->tp->world, local ? absl::AbortedError("failed") : absl::OkStatus());
  return local ? local : FromAbslIn(fn, all);
}

}  // namespace sg::cabi
