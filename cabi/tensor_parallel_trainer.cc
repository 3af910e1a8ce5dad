#include "cabi/tensor_parallel_trainer.h"

#include <dlfcn.h>
#include <stdlib.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"

namespace sg::cabi {

absl::Status AgreeAcrossRanks(dist::Communicator& comm, const absl::Status& local) {
  std::vector<int64_t> failed = {local.ok() ? comm.size() : comm.rank()};  // the first failing rank, or size
  if (absl::Status s = comm.AllReduce(failed, dist::ReduceOp::kMin); !s.ok()) return s;
  if (!local.ok()) return local;
  if (failed[0] == comm.size()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("rank ", failed[0], " of ", comm.size(), " failed (its status says why)"));
}

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
      "OpenMPI's libmpi.so.40: ", errors));
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

absl::StatusOr<std::unique_ptr<TensorParallelRun>> JoinTensorParallel(Model& whole, int tp,
                                                                      const absl::Status& precheck) {
  absl::StatusOr<std::unique_ptr<dist::Communicator>> world = CreateWorld();
  if (!world.ok()) return world.status();
  auto run = std::make_unique<TensorParallelRun>();
  run->world = std::move(*world);
  absl::StatusOr<dist::TensorParallelGrid> grid = dist::CreateTensorParallelGrid(*run->world, tp);
  if (!grid.ok()) return grid.status();  // the same verdict on every rank
  run->grid = std::move(*grid);
  absl::Status local = precheck;
  if (local.ok()) {
    absl::StatusOr<std::unique_ptr<Model>> split = dist::SplitModel(whole, run->grid.layers());
    if (split.ok()) run->split = std::move(*split);
    else if (absl::StartsWith(split.status().message(), "--tp")) local = split.status();
    else local = absl::Status(split.status().code(), absl::StrCat("--tp=", tp, ": ", split.status().message()));
  }
  if (absl::Status s = AgreeAcrossRanks(*run->world, local); !s.ok()) return s;
  return run;
}

absl::Status CheckSameRun(TensorParallelRun& run, Trainer& split) {
  // The whole model's configuration (a meta twin), as checkpoints record it.
  absl::StatusOr<dist::WholeTrainer> meta = dist::MakeWholeTrainer(split, Device::kMeta);
  absl::Status local = meta.status();
  RunConfig config;
  if (meta.ok()) {
    config = TrainerRunConfig(*meta->trainer);
    config.erase(absl::StrCat(kRuntimePrefix, "threads"));  // ranks may use different thread counts
  }
  if (absl::Status s = AgreeAcrossRanks(*run.world, local); !s.ok()) return s;
  if (absl::Status s = dist::CheckSameConfig(*run.world, config); !s.ok()) return s;
  if (run.grid.dp->size() > 1) run.data_parallel = std::make_unique<dist::DataParallel>(split, *run.grid.dp);
  return absl::OkStatus();
}

absl::StatusOr<StepMetrics> Gradients(Trainer& trainer, TensorParallelRun* run, const Batch& batch, bool accumulate) {
  if (!run || !run->data_parallel) return accumulate ? trainer.AccumulateGradients(batch) : trainer.ComputeGradients(batch);
  if (accumulate)
    return absl::UnimplementedError(absl::StrCat(
        "accumulating micro-batches across ", run->grid.dp->size(),
        " tensor-parallel groups: pass the whole batch to compute_gradients / step (each group takes its share)"));
  uint64_t first = 0;
  const Batch shard = dist::ShardOf(batch, run->grid.dp->rank(), run->grid.dp->size(), &first);
  return run->data_parallel->ComputeGradients(shard, first);
}

absl::Status WriteOnRankZero(dist::Communicator& comm, const std::function<absl::Status()>& write) {
  absl::Status mine = comm.rank() == 0 ? write() : absl::OkStatus();
  // Rank 0's code and message, as int32s (the element types a communicator carries).
  std::vector<int32_t> head = {static_cast<int32_t>(mine.code()), static_cast<int32_t>(mine.message().size())};
  if (absl::Status s = comm.Broadcast(head.data(), 2, DType::kI32, 0); !s.ok()) return s;
  std::vector<int32_t> text(head[1]);
  for (size_t i = 0; i < text.size() && comm.rank() == 0; ++i) text[i] = static_cast<unsigned char>(mine.message()[i]);
  if (head[1] > 0)
    if (absl::Status s = comm.Broadcast(text.data(), head[1], DType::kI32, 0); !s.ok()) return s;
  if (comm.rank() == 0 || head[0] == 0) return mine;
  std::string message = "rank 0: ";
  for (int32_t c : text) message.push_back(static_cast<char>(c));
  return absl::Status(static_cast<absl::StatusCode>(head[0]), message);
}

absl::StatusOr<dist::WholeTrainer> GatherWhole(Trainer& split) {
  absl::StatusOr<dist::WholeTrainer> whole = dist::MakeWholeTrainer(split, Device::kCPU);
  if (!whole.ok()) return whole.status();
  if (absl::Status s = dist::GatherTrainer(split, *whole->trainer); !s.ok()) return s;
  return whole;
}

}  // namespace sg::cabi
