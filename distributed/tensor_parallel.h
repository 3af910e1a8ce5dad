// Tensor parallelism across the ranks of a job (the layers' side is core/tensor_parallel.h): the grid of
// tensor-parallel groups × data-parallel groups, its checks at start, moving a split trainer to and from a whole
// one (checkpoints and saves are ordinary, whole Hugging Face files), and a split run beside a whole model its
// caller keeps (the C ABI's sg_trainer_options.tp).
//
// Layout: world rank w is tensor-parallel rank w % tp of group w / tp; the ranks with the same w % tp form a
// data-parallel group (they hold the same blocks and see different records).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/tensor_parallel.h"
#include "core/trainer.h"
#include "distributed/data_parallel.h"

namespace sg::dist {

struct TensorParallelGrid {
  std::unique_ptr<Communicator> tp;  // this rank's tensor-parallel group
  std::unique_ptr<Communicator> dp;  // the ranks holding the same blocks
  TensorParallel layers() const { return {tp->rank(), tp->size(), tp.get()}; }
};

// Collective over `world`: every rank passes its tp; refused on every rank, listing each rank's value, when they
// differ. Every rank of a job calls it, also those that run without tensor parallelism (tp 1).
absl::Status CheckSameTp(Communicator& world, int tp);

// Collective over `world`: every rank passes its tp. Refused on every rank, with the numbers, when the ranks
// disagree on tp (each rank's value listed), tp < 1, or the world size is not tp × dp.
absl::StatusOr<TensorParallelGrid> CreateTensorParallelGrid(Communicator& world, int tp);

// This rank's part of a whole transformer or Mamba (LoRA adapters included) on `device` (the whole model's when
// omitted): a new model holding its blocks of the whole one's values. A GPU run loads the whole model into host
// memory and splits it onto the GPU, which then holds only its blocks.
absl::StatusOr<std::unique_ptr<Model>> SplitModel(Model& whole, const TensorParallel& tp,
                                                  std::optional<Device> device = std::nullopt);

// A whole, zero-initialised twin of a split trainer on `device` (meta: shapes only): the same configuration,
// weight dtype, LoRA options and strategy, optimizer and objective options, so that its TrainerRunConfig, its
// checkpoints and saves are those of one process.
struct WholeTrainer {
  std::unique_ptr<Model> model;
  std::unique_ptr<Trainer> trainer;
};
absl::StatusOr<WholeTrainer> MakeWholeTrainer(Trainer& split, Device device);

// Whole trainer (every rank) -> split trainer: weights, AdamW moments and fp32 masters (when `whole` has them),
// step and sampling counter. No communication.
absl::Status ScatterTrainer(Trainer& whole, Trainer& split);
// Split trainer -> whole trainer on every rank of the group (collective over the split model's group).
absl::Status GatherTrainer(Trainer& split, Trainer& whole);

// The whole trainer (gathered weights, moments, masters, step) on every rank of the group, for checkpoints.
absl::StatusOr<WholeTrainer> GatherWholeTrainer(Trainer& split);

// A split trainer's job beside the whole model its caller keeps showing: the caller's values go into this rank's
// blocks before each call and the group's blocks back into the whole model after it.
struct TensorParallelRun {
  std::unique_ptr<Communicator> world;  // the job (outlives the grid split from it)
  TensorParallelGrid grid;
  std::unique_ptr<Model> split;  // this rank's blocks of the whole model
  // More than one group (a job of tp x dp ranks): the groups' gradients summed over the ranks holding the same
  // blocks, each group computing its share of the batch every rank passes (train's TP x DP grid).
  std::unique_ptr<DataParallel> data_parallel;
  int64_t bytes_last_call = 0;  // sent over the group by the last call's forward, backward and optimizer step

  // The whole model's values (which its owner may have written) and memory limit into this rank's blocks.
  absl::Status ScatterFrom(Model& whole);
  // Collective over the group: its blocks' gradients and/or values gathered into `whole`.
  absl::Status GatherInto(Model& whole, bool grads, bool values);
  // Bytes this rank sent over its group so far.
  int64_t bytes_communicated() const { return grid.tp->bytes_communicated(); }
};

// Collective over `world`, the job: forms the grid of tp-rank groups x data-parallel groups and splits `whole` onto
// this rank's blocks. Refused on every rank, with the numbers, when the ranks disagree on tp, the job is not a
// multiple of tp ranks, or the model does not split over tp; a failure on one rank fails the others too, naming it:
// `precheck` is this rank's verdict on its own arguments.
absl::StatusOr<std::unique_ptr<TensorParallelRun>> JoinTensorParallel(std::unique_ptr<Communicator> world, Model& whole,
                                                                      int tp, const absl::Status& precheck);

// Collective over the job: every rank must train the same model with the same options. Then, with more than one
// group, run.data_parallel over `split`.
absl::Status CheckSameRun(TensorParallelRun& run, Trainer& split);

// The gradients of `batch` (the same on every rank) by `trainer`, the split one of `run` (null: no tensor
// parallelism): with more than one group, each computes its shard (ShardOf) and the gradients are summed across
// groups. accumulate: Trainer::AccumulateGradients (one group only: refused across groups).
absl::StatusOr<StepMetrics> ComputeGradients(Trainer& trainer, TensorParallelRun* run, const Batch& batch,
                                             bool accumulate);

}  // namespace sg::dist
