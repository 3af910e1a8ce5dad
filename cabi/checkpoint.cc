// Checkpoints of a trainer: saving, loading and resuming from the latest. Under tensor parallelism a checkpoint holds
// the whole model (sg::dist's whole trainer), so that it crosses tp and one process both ways.
#include "core/checkpoint.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cabi/internal.h"

namespace sg::cabi {
namespace {

// Loads a checkpoint directory into the trainer (its busy guard held), refusing a differing run configuration.
sg_status* LoadInto(const char* fn, sg_trainer* t, const char* dir, int64_t* step, int64_t* data_position) {
  if (sg_status* s = Agree(fn, t, nullptr)) return s;
  std::optional<dist::WholeTrainer> whole;
  if (t->tp) {
    absl::StatusOr<dist::WholeTrainer> w = dist::MakeWholeTrainer(*t->trainer, Device::kCPU);
    if (!w.ok()) return FromAbslIn(fn, w.status());
    whole = std::move(*w);
  }
  Trainer& trainer = whole ? *whole->trainer : *t->trainer;
  const RunConfig expected = TrainerRunConfig(trainer);
  absl::StatusOr<CheckpointMeta> meta = LoadCheckpoint(dir, trainer, &expected);
  if (t->tp) {  // every rank loads it; all restore, or none
    if (absl::Status s = dist::AgreeAcrossRanks(*t->tp->world, meta.status()); !s.ok()) return FromAbslIn(fn, s);
    if (absl::Status s = dist::ScatterTrainer(trainer, *t->trainer); !s.ok()) return FromAbslIn(fn, s);
    if (absl::Status s = ShowWholeModel(t, false, true); !s.ok()) return FromAbslIn(fn, s);
  }
  if (!meta.ok()) return FromAbslIn(fn, meta.status());
  // The header promises these on stderr: the load succeeded, but the run is no longer bit-exact.
  for (const std::string& w : meta->warnings)
    std::fprintf(stderr, "seqgrad: warning: %s: %s: %s\n", fn, dir, w.c_str());
  t->last = StepMetrics{};
  if (step) *step = meta->trainer.step;
  if (data_position) *data_position = meta->data_position;
  return nullptr;
}

}  // namespace
}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_status* sg_trainer_save_checkpoint(sg_trainer* trainer, const char* out_dir, int64_t data_position, int64_t keep) {
  static const char fn[] = "sg_trainer_save_checkpoint";
  return Guard(fn, [&] {
    return Agreed(fn, trainer, [&]() -> sg_status* {
      if (!trainer) return NullArg(fn, "trainer");
      if (!out_dir) return NullArg(fn, "out_dir");
      if (data_position < 0)
        return Invalid(absl::StrCat(fn, ": argument 'data_position' is ", data_position, "; need >= 0"));
      if (keep < 0 || keep > INT32_MAX)
        return Invalid(absl::StrCat(fn, ": argument 'keep' is ", keep, "; need >= 0 (0 = keep every checkpoint)"));
      BusyGuard guard(*trainer->core);
      if (!guard.acquired()) return Busy(fn);
      if (sg_status* s = Agree(fn, trainer, nullptr)) return s;
      std::optional<sg::dist::WholeTrainer> whole;
      if (trainer->tp) {
        absl::StatusOr<sg::dist::WholeTrainer> w = sg::dist::GatherWholeTrainer(*trainer->trainer);
        if (!w.ok()) return FromAbslIn(fn, w.status());
        whole = std::move(*w);
      }
      sg::Trainer& t = whole ? *whole->trainer : *trainer->trainer;
      auto save = [&]() -> absl::Status {
        sg::CheckpointMeta meta;
        meta.trainer = t.state();
        meta.seed = t.strategy().seed;
        meta.data_position = data_position;
        meta.run_config = sg::TrainerRunConfig(t);
        return sg::SaveCheckpoint(out_dir, t, meta, static_cast<int>(keep)).status();
      };
      return FromAbslIn(fn, whole ? sg::dist::WriteOnRankZero(*trainer->tp->world, save) : save());
    });
  });
}

sg_status* sg_trainer_load_checkpoint(sg_trainer* trainer, const char* checkpoint_dir, int64_t* step,
                                      int64_t* data_position) {
  static const char fn[] = "sg_trainer_load_checkpoint";
  return Guard(fn, [&] {
    return Agreed(fn, trainer, [&]() -> sg_status* {
      if (!trainer) return NullArg(fn, "trainer");
      if (!checkpoint_dir) return NullArg(fn, "checkpoint_dir");
      if (sg_status* s = CheckDirectory(fn, "checkpoint_dir", checkpoint_dir)) return s;
      BusyGuard guard(*trainer->core);
      if (!guard.acquired()) return Busy(fn);
      return LoadInto(fn, trainer, checkpoint_dir, step, data_position);
    });
  });
}

sg_status* sg_trainer_resume(sg_trainer* trainer, const char* out_dir, int64_t* step, int64_t* data_position) {
  static const char fn[] = "sg_trainer_resume";
  return Guard(fn, [&] {
    return Agreed(fn, trainer, [&]() -> sg_status* {
      if (!trainer) return NullArg(fn, "trainer");
      if (!out_dir) return NullArg(fn, "out_dir");
      BusyGuard guard(*trainer->core);
      if (!guard.acquired()) return Busy(fn);
      std::vector<std::string> skipped;
      absl::StatusOr<std::string> latest = sg::FindLatestCheckpoint(out_dir, &skipped);
      if (!latest.ok()) {
        std::string msg = absl::StrCat(fn, ": ", latest.status().message());
        if (!skipped.empty()) absl::StrAppend(&msg, "; skipped damaged: ", absl::StrJoin(skipped, "; "));
        return MakeStatus(static_cast<int>(latest.status().code()), std::move(msg));
      }
      return LoadInto(fn, trainer, latest->c_str(), step, data_position);
    });
  });
}

}  // extern "C"
