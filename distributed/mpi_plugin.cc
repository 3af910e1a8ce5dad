#include "distributed/mpi_plugin.h"

#include <dlfcn.h>
#include <stdlib.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace sg::dist {
namespace {

// cabi/mpi_plugin.cc's entry point.
using CreateMpiFn = Communicator* (*)(std::string** error);

std::string RealPath(const std::string& path) {
  char* r = realpath(path.c_str(), nullptr);
  if (!r) return path;
  std::string out = r;
  free(r);
  return out;
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// Where the plug-in may be, in the order tried.
std::vector<std::string> Candidates() {
  std::vector<std::string> paths;
  if (const char* env = std::getenv("SEQGRAD_MPI_PLUGIN")) paths.push_back(env);
  Dl_info info;  // the program or shared library this code is in
  if (dladdr(reinterpret_cast<void*>(&Candidates), &info) && info.dli_fname) {
    paths.push_back(DirectoryOf(info.dli_fname) + "/libseqgrad_mpi.so");
    paths.push_back(DirectoryOf(RealPath(info.dli_fname)) + "/libseqgrad_mpi.so");
  }
  const std::string runfile = "/seqgrad/cabi/libseqgrad_mpi.so";
  for (const char* env : {"RUNFILES_DIR", "TEST_SRCDIR"})
    if (const char* dir = std::getenv(env)) paths.push_back(dir + runfile);
  paths.push_back(RealPath("/proc/self/exe") + ".runfiles" + runfile);
  return paths;
}

// The plug-in's factory, loaded once. RTLD_GLOBAL: OpenMPI's own components look up libmpi's symbols globally.
absl::StatusOr<CreateMpiFn> MpiFactory(absl::string_view what) {
  static std::mutex mu;
  static CreateMpiFn factory = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (factory) return factory;
  std::string errors;
  for (const std::string& path : Candidates()) {
    if (void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      factory = reinterpret_cast<CreateMpiFn>(dlsym(lib, "seqgrad_internal_create_mpi_communicator"));
      if (factory) return factory;
    }
    const char* why = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", why ? why : path);
  }
  return absl::FailedPreconditionError(
      absl::StrCat(what,
                   ": MPI needs libseqgrad_mpi.so (beside the program or libseqgrad.so, or named by "
                   "SEQGRAD_MPI_PLUGIN) and OpenMPI's libmpi.so.40: ",
                   errors));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> JoinMpiJob(absl::string_view what) {
  absl::StatusOr<CreateMpiFn> create = MpiFactory(what);
  if (!create.ok()) return create.status();
  std::string* error = nullptr;
  std::unique_ptr<Communicator> world((*create)(&error));
  if (world) return world;
  std::unique_ptr<std::string> owned(error);
  return absl::UnavailableError(absl::StrCat(what, ": joining the MPI job: ", owned ? *owned : "unknown error"));
}

}  // namespace sg::dist
