// Tensor parallelism behind the C ABI (sg_trainer_options.tp): a trainer joins the MPI job, trains this rank's
// blocks of the handle's (whole) model, and keeps the handle showing the whole model, so that views, saves and
// checkpoints are those of one process (docs/design.md "Parallelism").
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/model.h"
#include "core/trainer.h"
#include "distributed/data_parallel.h"
#include "distributed/tensor_parallel.h"

namespace sg::cabi {

struct TensorParallelRun {
  std::unique_ptr<dist::Communicator> world;  // the job (outlives the grid split from it)
  dist::TensorParallelGrid grid;
  std::unique_ptr<Model> split;  // this rank's blocks of the whole model
  // More than one group (a job of tp x dp ranks): the groups' gradients summed over the ranks holding the same
  // blocks, each group computing its share of the batch every rank passes (train's TP x DP grid).
  std::unique_ptr<dist::DataParallel> data_parallel;
  int64_t bytes_last_call = 0;  // sent over the group by the last call's forward, backward and optimizer step
};

// The gradients of `batch` (the same on every rank) by the trainer of `run` (null: no tensor parallelism):
// with more than one group, each computes its shard (dist::ShardOf) and the gradients are summed across groups.
// accumulate: Trainer::AccumulateGradients (one group only: refused across groups).
absl::StatusOr<StepMetrics> Gradients(Trainer& trainer, TensorParallelRun* run, const Batch& batch, bool accumulate);

// Collective over the job: joins it (MPI), forms the grid of tp-rank groups x data-parallel groups (world rank w is
// tensor rank w % tp of group w / tp) and splits `whole` onto this rank's blocks. Refused on every rank, with the
// numbers, when the ranks disagree on tp, the job is not a multiple of tp ranks, or the model does not split over
// tp; a failure on one rank fails the others too, naming it: `precheck` is this rank's verdict on its own arguments.
absl::StatusOr<std::unique_ptr<TensorParallelRun>> JoinTensorParallel(Model& whole, int tp,
                                                                      const absl::Status& precheck);

// Collective over the job: every rank must train the same model with the same options. Then, with more than one
// group, run.data_parallel over `split`.
absl::Status CheckSameRun(TensorParallelRun& run, Trainer& split);

// Collective over `comm`: OK when every rank's `local` is; otherwise this rank's error, or one naming the first
// rank that failed, so that no rank goes on into a collective the others skip.
absl::Status AgreeAcrossRanks(dist::Communicator& comm, const absl::Status& local);

// Collective over the group: rank 0 runs `write` (only it writes files); every rank returns rank 0's status.
absl::Status WriteOnRankZero(dist::Communicator& comm, const std::function<absl::Status()>& write);

// The whole trainer (gathered weights, moments, masters, step) on every rank of the group, for checkpoints.
absl::StatusOr<dist::WholeTrainer> GatherWhole(Trainer& split);

}  // namespace sg::cabi
