// Tensor parallelism across the ranks of a job (the layers' side is core/tensor_parallel.h): the grid of
// tensor-parallel groups × data-parallel groups, its checks at start, and moving a split trainer to and from a whole
// one (checkpoints and saves are ordinary, whole Hugging Face files).
//
// Layout: world rank w is tensor-parallel rank w % tp of group w / tp; the ranks with the same w % tp form a
// data-parallel group (they hold the same blocks and see different records).
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/tensor_parallel.h"
#include "core/trainer.h"

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

}  // namespace sg::dist
