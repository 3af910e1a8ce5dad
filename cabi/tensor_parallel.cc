// Tensor parallelism behind the C ABI (sg_trainer_options.tp): a trainer joins the MPI job, trains this rank's
// blocks of the handle's (whole) model, and keeps the handle showing the whole model, so that views, saves and
// checkpoints are those of one process (docs/design.md "Parallelism"). The engine side is sg::dist's; here the job
// is joined through the MPI plug-in and the handles' calls agree across ranks.
#include <dlfcn.h>
#include <stdlib.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {
namespace {

using CreateMpiFn = dist::Communicator* (*)(std::string** error);

// The directory of the file `address` was loaded from, following symlinks (Bazel's runfiles, a bundle) when `real`.
std::string DirectoryOf(void* address, bool real) {
  Dl_info info;
  if (!dladdr(address, &info) || !info.dli_fname) return "";
  std::string path = info.dli_fname;
  if (real)
    if (char* r = realpath(path.c_str(), nullptr)) {
      path = r;
      free(r);
    }
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// libseqgrad_mpi.so's factory, loaded once: SEQGRAD_MPI_PLUGIN, else beside libseqgrad.so (as loaded, then with
// symlinks resolved). RTLD_GLOBAL: OpenMPI's own components look up libmpi's symbols globally.
absl::StatusOr<CreateMpiFn> MpiFactory() {
  static std::mutex mu;
  static CreateMpiFn factory = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (factory) return factory;
  std::vector<std::string> tried;
  if (const char* env = std::getenv("SEQGRAD_MPI_PLUGIN")) tried.push_back(env);
  for (bool real : {false, true}) {
    const std::string dir = DirectoryOf(reinterpret_cast<void*>(&MpiFactory), real);
    if (!dir.empty()) tried.push_back(dir + "/libseqgrad_mpi.so");
  }
  std::string errors;
  for (const std::string& path : tried) {
    if (void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      factory = reinterpret_cast<CreateMpiFn>(dlsym(lib, "seqgrad_internal_create_mpi_communicator"));
      if (factory) return factory;
    }
    const char* why = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", why ? why : path);
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--tp: tensor parallelism needs libseqgrad_mpi.so (beside libseqgrad.so, or named by SEQGRAD_MPI_PLUGIN) and "
      "OpenMPI's libmpi.so.40: ",
      errors));
}

absl::StatusOr<std::unique_ptr<dist::Communicator>> CreateWorld() {
  absl::StatusOr<CreateMpiFn> create = MpiFactory();
  if (!create.ok()) return create.status();
  std::string* error = nullptr;
  std::unique_ptr<dist::Communicator> world((*create)(&error));
  if (world) return world;
  std::unique_ptr<std::string> owned(error);
  return absl::UnavailableError(absl::StrCat("--tp: joining the MPI job: ", owned ? *owned : "unknown error"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<dist::TensorParallelRun>> JoinTensorParallel(Model& whole, int tp,
                                                                            const absl::Status& precheck) {
  absl::StatusOr<std::unique_ptr<dist::Communicator>> world = CreateWorld();
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
