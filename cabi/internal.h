// What the files of the C ABI's implementation share: the handles, the status plumbing, the published struct sizes
// and the helpers of the trainer calls. The C ABI only converts: arguments and handles into engine calls, statuses
// and exceptions into sg_status (absl's codes).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/communicator.h"
#include "base/errno_status.h"
#include "base/tensor.h"
#include "core/model.h"
#include "core/objective.h"
#include "core/trainer.h"
#include "distributed/tensor_parallel.h"
#include "seqgrad/seqgrad.h"

struct sg_status {
  int code;
  std::string message;
};

struct ModelCore {
  std::unique_ptr<sg::Model> model;  // any family (transformer or ssm), only through the generic interface
  std::atomic<bool> busy{false};
  // Trainers of this model (sg_trainer_create .. sg_trainer_free): LoRA cannot be enabled under them. Guarded by mu,
  // which also orders a trainer's creation against enabling LoRA.
  std::mutex mu;
  int trainers = 0;
  std::string lora_targets;  // sg_model_lora's targets string (joined once LoRA is on)
  std::string source_dir;    // sg_model_load's directory (absolute), whose tokenizer etc. sg_model_save carries over
  // The job of this model's tensor-parallel trainer (at most one), under mu: saves are then written by its rank 0.
  sg::dist::Communicator* tp_group = nullptr;
};

struct sg_model {
  std::shared_ptr<ModelCore> core;
};

struct sg_trainer {
  std::shared_ptr<ModelCore> core;
  sg::ObjectiveOptions objective;
  std::shared_ptr<ModelCore> reference;             // NULL: none; kept alive here while `trainer` points to it
  std::unique_ptr<sg::dist::TensorParallelRun> tp;  // options.tp > 1: the job and this rank's blocks (`trainer`'s)
  std::unique_ptr<sg::Trainer> trainer;
  std::atomic<bool> cancel{false};
  sg_progress_fn progress = nullptr;
  void* progress_user = nullptr;
  sg::StepMetrics last;  // loss/tokens of the last compute_gradients, reported by optimizer_step
  bool agreed = false;   // tensor parallel: the call in progress has agreed with the other ranks (Agree)
  ~sg_trainer() {
    if (!trainer) return;
    std::lock_guard<std::mutex> lock(core->mu);
    --core->trainers;
    if (tp) core->tp_group = nullptr;
  }
};

namespace sg::cabi {

// Statuses (status.cc).

// Returned when even the status cannot be allocated; sg_status_free recognises it and does not delete it.
sg_status* OutOfMemoryStatus();
sg_status* MakeStatus(int code, std::string message);
sg_status* Invalid(std::string message);
// The core names options by the tools' flags ("--chunk"); the C API by the fields of its option structs
// ("options->chunk").
std::string FieldMessage(absl::string_view message);
sg_status* FromAbsl(const absl::Status& s);
// A core status with the C function's name in front.
sg_status* FromAbslIn(const char* fn, const absl::Status& s);
sg_status* NullArg(const char* fn, const char* arg);
sg_status* Busy(const char* fn);
sg_status* Cancelled(const char* fn);
// NULL when `path` (argument `arg`) is a directory; NOT_FOUND for another kind of file; when stat fails, the code of
// its errno (sg::ErrnoCode, as everywhere: ENOENT NOT_FOUND, ENOTDIR FAILED_PRECONDITION, ...).
sg_status* CheckDirectory(const char* fn, const char* arg, const char* path);

// Runs f, turning exceptions into statuses: out of memory is RESOURCE_EXHAUSTED with the bytes asked and
// available, an I/O error its errno's code, anything else INTERNAL naming fn.
template <typename F>
sg_status* Guard(const char* fn, F&& f) {
  try {
    return f();
  } catch (...) {
    try {
      return FromAbsl(StatusOfCurrentException(fn));
    } catch (...) {
      return OutOfMemoryStatus();
    }
  }
}

// Marks the model busy for the lifetime of the guard; acquired() is false when another thread holds it.
class BusyGuard {
 public:
  explicit BusyGuard(ModelCore& c) : c_(c) {
    bool expected = false;
    acquired_ = c_.busy.compare_exchange_strong(expected, true, std::memory_order_acquire);
  }
  ~BusyGuard() {
    if (acquired_) c_.busy.store(false, std::memory_order_release);
  }
  bool acquired() const { return acquired_; }

 private:
  ModelCore& c_;
  bool acquired_ = false;
};

// The published struct sizes.

// Sizes of the size-versioned structs in older headers: programs built against them pass these. Their layouts are
// frozen; later fields are appended. (sg_metrics did not change in 0.3: its 0.2 size is also the 0.3 size.)
inline constexpr size_t kTrainerOptionsSize0_1 = offsetof(sg_trainer_options, spaco_budget);
inline constexpr size_t kTrainerOptionsSize0_2 = offsetof(sg_trainer_options, objective);
inline constexpr size_t kTrainerOptionsSize0_3 = offsetof(sg_trainer_options, adjoint_form);
inline constexpr size_t kTrainerOptionsSize0_4 = offsetof(sg_trainer_options, lr_schedule);
inline constexpr size_t kTrainerOptionsSize0_5 = offsetof(sg_trainer_options, sparse_pages);
inline constexpr size_t kMetricsSize0_1 = offsetof(sg_metrics, chunks);
inline constexpr size_t kMetricsSize0_3 = offsetof(sg_metrics, adjoint_pairs);  // = the 0.2 size
inline constexpr size_t kMetricsSize0_4 = offsetof(sg_metrics, lr);
inline constexpr size_t kMetricsSize0_6 = offsetof(sg_metrics, peak_bytes_master_weights);  // = the 0.5 size
inline constexpr size_t kParamInfoSize0_6 = offsetof(sg_param_info, on_device);
inline constexpr size_t kTrainerOptionsSize0_6 = offsetof(sg_trainer_options, tp);  // = 0.7 before tp
inline constexpr size_t kMetricsSize0_7 = offsetof(sg_metrics, tp);                 // 0.7 before tp
inline constexpr size_t kTrainerOptionsSize0_7 = offsetof(sg_trainer_options, grpo_kl_bias_correction);  // with tp
inline constexpr size_t kTrainerOptionsSize0_7_0 = offsetof(sg_trainer_options, offload_experts);  // = 0.7.0's size
inline constexpr size_t kModelOptionsSize0_7 = offsetof(sg_model_options, frozen_base);
static_assert(kTrainerOptionsSize0_1 == 216 && kMetricsSize0_1 == 184, "the 0.1 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_2 == 240 && kMetricsSize0_3 == 200, "the 0.2 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_3 == 272, "the 0.3 (LP64) layout changed: append only");
static_assert(kTrainerOptionsSize0_4 == 288 && kMetricsSize0_4 == 208, "the 0.4 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_5 == 328 && kMetricsSize0_6 == 224 && sizeof(sg_lora_options) == 48 &&
                  sizeof(sg_eval_result) == 1616,
              "the 0.5 (LP64) layouts changed: append only");
static_assert(kMetricsSize0_7 == 240, "the 0.7 (LP64) sg_metrics changed: append only");
static_assert(kTrainerOptionsSize0_6 == 344,
              "the 0.6 (LP64) layout changed: append only (0.7 renamed reserved_0_6 to num_threads, the same size)");
static_assert(sizeof(sg_metrics) == 256 && kTrainerOptionsSize0_7 == 352, "the 0.7 (LP64) layouts with tp");
static_assert(kTrainerOptionsSize0_7_0 == 360, "the 0.7 (LP64) layout with grpo_kl_bias_correction");
static_assert(sizeof(sg_trainer_options) == 368, "the 0.8 (LP64) layout with offload_experts");
static_assert(kModelOptionsSize0_7 == 32, "the 0.7 (LP64) sg_model_options changed: append only");

struct PublishedSize {
  const char* version;
  size_t size;
};
// The older sizes each struct_size check accepts besides this library's.
inline constexpr PublishedSize kTrainerOptionsSizes[] = {
    {"0.1", kTrainerOptionsSize0_1},
    {"0.2", kTrainerOptionsSize0_2},
    {"0.3", kTrainerOptionsSize0_3},
    {"0.4", kTrainerOptionsSize0_4},
    {"0.5", kTrainerOptionsSize0_5},
    {"0.6", kTrainerOptionsSize0_6},
    {"0.7 (before grpo_kl_bias_correction)", kTrainerOptionsSize0_7},
    {"0.7", kTrainerOptionsSize0_7_0}};
inline constexpr PublishedSize kMetricsSizes[] = {{"0.1", kMetricsSize0_1},
                                                  {"0.3", kMetricsSize0_3},
                                                  {"0.4", kMetricsSize0_4},
                                                  {"0.6", kMetricsSize0_6},
                                                  {"0.7 (before tp)", kMetricsSize0_7}};
inline constexpr PublishedSize kParamInfoSizes[] = {{"0.6", kParamInfoSize0_6}};
inline constexpr PublishedSize kModelOptionsSizes[] = {{"0.7", kModelOptionsSize0_7}};

// A struct_size is accepted when it is a published version's (`older`) or at least this library's.
sg_status* CheckStructSize(const char* fn, const char* arg, size_t got, size_t want,
                           absl::Span<const PublishedSize> older = {});

// Batches: the C arrays into engine sequences (batch.cc).

// The engine's sequence of one C API sequence of n tokens, whose labels follow Hugging Face: aligned with ids (hf
// NULL: next-token labels, hf = ids). Its inputs are ids[0, n - 1), position t predicting hf[t + 1]: the last token
// is only a label, as in the JSONL path, so transformers' len(input_ids), from which dynamic RoPE scales, is n
// (TransformerModel::TokensOfSequence). n = 1 leaves no position: empty.
Sequence EngineSequence(const int32_t* ids, const int32_t* hf, int64_t n);

// The sequences with positions: the engine refuses empty ones (C API sequences of one token).
std::vector<Sequence> WithPositions(std::vector<Sequence> batch);

// The flat arrays of the calls without documents as an sg_batch.
sg_batch FlatBatch(const int32_t* ids, const int32_t* labels, int64_t num_tokens, const int64_t* lengths,
                   int64_t num_sequences);

// A *_batch call's batch: not NULL, of a known size.
sg_status* CheckBatch(const char* fn, const sg_batch* b);

// Builds the batch from its arrays (one engine sequence per C sequence, empty for one token, with its documents),
// checking each argument; a batch without any label is refused unless allow_unlabelled.
sg_status* BuildBatch(const char* fn, int64_t vocab, const sg_batch& b, std::vector<Sequence>* batch,
                      bool allow_unlabelled = false);

// Sequence i of pointer arrays (ids[i], labels[i] of lengths[i] tokens), checked; the names are the C arguments'.
struct SequenceArgs {
  const char* ids_name;
  const char* labels_name;
  const char* lengths_name;
  const int32_t* const* ids;
  const int32_t* const* labels;  // NULL or entries NULL: next-token labels
  const int64_t* lengths;
};
sg_status* BuildSequence(const char* fn, int64_t vocab, const SequenceArgs& a, int64_t i, Sequence* out);

// Tensor parallelism: the handles over sg::dist (tensor_parallel.cc).

// Collective over the MPI job (the libseqgrad_mpi.so plug-in): sg::dist::JoinTensorParallel on it.
absl::StatusOr<std::unique_ptr<dist::TensorParallelRun>> JoinTensorParallel(Model& whole, int tp,
                                                                            const absl::Status& precheck);

// Tensor parallel: the handle's whole values (which the caller may have written) into this rank's blocks, before a
// call of the trainer ...
absl::Status TakeHandleValues(sg_trainer* t);
// ... and after it the group's blocks gathered into the handle (collective), so that it shows the whole model.
absl::Status ShowWholeModel(sg_trainer* t, bool grads, bool values);
// Bytes this rank sent over its tensor-parallel group so far (0 without one).
int64_t TpBytes(const sg_trainer* t);

// Tensor parallel: before the collective part of a call, every rank learns whether all got there; `local` is this
// rank's verdict (NULL = ready). A rank that failed returns its own error, the others one naming it, so no rank waits
// in a collective another skipped (a bad argument on one rank fails every rank at once).
sg_status* Agree(const char* fn, sg_trainer* t, sg_status* local);

// Runs a trainer call `f` (-> sg_status*) that calls Agree before its collective part; a failure before it agrees.
template <typename F>
sg_status* Agreed(const char* fn, sg_trainer* t, F&& f) {
  if (t) t->agreed = false;
  sg_status* s = f();
  return t ? Agree(fn, t, s) : s;
}

// Trainer calls (step.cc, metrics.cc, memory.cc).

enum class Call { kGradients, kStep, kEvaluate, kAccumulate, kScore };

sg_status* WrongObjective(const char* fn, const sg_trainer* t, const char* needs, const char* use);

// Runs `compute` with the trainer's model marked busy, and its reference too when `with_reference`; `check`, when
// given (its NULL = fine), first looks at what that guards (the reference). kGradients/kStep report progress and keep
// the metrics for optimizer_step; kStep then clips and applies AdamW.
sg_status* Run(const char* fn, sg_trainer* t, Call call, bool with_reference, sg_metrics* out,
               const std::function<sg_status*()>& check, const std::function<absl::StatusOr<StepMetrics>()>& compute);

sg_status* CheckMetrics(const char* fn, const sg_metrics* out);
// The memory is that of the trained model: this rank's blocks under tensor parallelism.
void FillMetrics(const StepMetrics& m, const sg_trainer* t, double seconds, sg_metrics* out);

// The first optimizer step allocates AdamW's two moments per trained parameter. Checked up front against the memory
// limit: the core would fail halfway through that allocation and keep the moments it got.
sg_status* CheckOptimizerMemory(const char* fn, sg_trainer* t);

}  // namespace sg::cabi
