// Training checkpoints: everything a run needs to continue bit-identically, in <out_dir>/checkpoint-<step>/:
//   model.safetensors      every parameter in the model's dtype (bit exact); with config.json a Hugging Face model
//                          directory
//   config.json            the model's Hugging Face config (transformers and Mamba)
//   optimizer.safetensors  the AdamW moments, "m.<parameter>" and "v.<parameter>" (none before the first step)
//   trainer_state.json     format and version, step, spaco's sampling counter, seed, data position, per-step history
//                          (losses, ...), the run's configuration, and each file's size and CRC-32; it carries its
//                          own CRC-32 too
// A checkpoint is written into a temporary directory (.tmp-checkpoint-<step>-<pid>), every file and the directory
// are fsynced, the directory is renamed to checkpoint-<step> and out_dir is fsynced: a kill at any moment leaves
// either the complete new checkpoint or none, and the previous ones untouched. Only directories named exactly
// checkpoint-<digits> are checkpoints; loading checks every file before anything is restored.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/trainer.h"

namespace sg {

// The run's configuration as flat name -> value strings ("strategy.chunk" -> "512"): a resume is refused when a
// field differs.
using RunConfig = std::map<std::string, std::string>;
// Fields of a RunConfig that a resume may change (the thread count): LoadCheckpoint warns instead of refusing.
inline constexpr char kRuntimePrefix[] = "runtime.";

struct CheckpointMeta {
  TrainerState trainer;  // optimizer step (the checkpoint's step) and spaco's sampling counter
  uint64_t seed = 0;
  int64_t data_position = 0;  // records of the training data consumed so far
  // Per-step series to continue after a resume, e.g. "loss" -> the loss of steps 1..step.
  std::map<std::string, std::vector<double>> history;
  RunConfig run_config;
  bool has_optimizer_state = false;   // set by ReadCheckpoint
  std::vector<std::string> warnings;  // set by LoadCheckpoint: runtime.* fields that differ (bit-exactness is lost)
};

// The model's configuration ("model.family", "model.dtype", "model.<HF config field>", parameter counts, LoRA's
// "lora.*"), the trainer's strategy, optimizer and objective options ("strategy.*", "optimizer.*", "objective.*")
// and its thread count ("runtime.threads"). Tools add their own fields (data, seq_len, ...).
RunConfig TrainerRunConfig(Trainer& trainer);

// Writes <out_dir>/checkpoint-<meta.trainer.step> (out_dir is created if missing; an existing checkpoint of that
// step is replaced) and then keeps it and the keep - 1 newest others (keep 0 = keep all). Temporaries of
// processes that no longer run are removed. Returns the checkpoint's directory.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& out_dir, Trainer& trainer, const CheckpointMeta& meta,
                                           int keep);

// Reads trainer_state.json and checks every file (present, size, CRC-32, safetensors header) without touching a
// model. Errors name the file and what is wrong.
absl::StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& dir);

// ReadCheckpoint, then checks the checkpoint's tensors against the trainer's model (names, shapes, dtypes) before
// restoring weights, optimizer moments and trainer state. If `expected` is given, a differing run configuration is
// refused first (FailedPrecondition listing the fields, see DiffRunConfig), except runtime.* fields, which only add
// CheckpointMeta::warnings.
absl::StatusOr<CheckpointMeta> LoadCheckpoint(const std::string& dir, Trainer& trainer,
                                              const RunConfig* expected = nullptr);

// checkpoint-<step> directories in out_dir, newest (highest step) first: {step, path}.
std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& out_dir);

// The newest checkpoint that ReadCheckpoint accepts. Newer ones that it refuses are described in *skipped (if not
// null). NotFound when there is none.
absl::StatusOr<std::string> FindLatestCheckpoint(const std::string& out_dir,
                                                 std::vector<std::string>* skipped = nullptr);

// One line per field whose value differs or that only one side has: "strategy.chunk: checkpoint 512, now 256".
std::vector<std::string> DiffRunConfig(const RunConfig& checkpoint, const RunConfig& now);

// CRC-32 (IEEE, as zlib's crc32) of bytes, continuing from crc.
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace sg
