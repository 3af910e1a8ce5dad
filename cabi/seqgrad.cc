// Implementation of the seqgrad C API (cabi/include/seqgrad/seqgrad.h) over the C++ engine.
// Every entry point catches all exceptions; statuses carry absl codes.
#include "seqgrad/seqgrad.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "base/tensor.h"
#include "cabi/tensor_parallel_trainer.h"
#include "core/checkpoint.h"
#include "core/eval.h"
#include "core/lora.h"
#include "core/lora_io.h"
#include "core/model_io.h"
#include "core/objective.h"
#include "core/presets.h"
#include "core/strategy.h"
#include "core/model.h"
#include "core/trainer.h"

struct sg_status {
  int code;
  std::string message;
};

namespace {

constexpr char kVersion[] = SG_VERSION_STRING;

// Returned when even the status cannot be allocated; sg_status_free recognises it and does not delete it.
sg_status* OutOfMemoryStatus() {
  static sg_status* oom = new sg_status{SG_ERR_RESOURCE_EXHAUSTED, "out of memory"};
  return oom;
}

sg_status* MakeStatus(int code, std::string message) {
  try {
    return new sg_status{code, std::move(message)};
  } catch (...) {
    return OutOfMemoryStatus();
  }
}
sg_status* Invalid(std::string message) { return MakeStatus(SG_ERR_INVALID_ARGUMENT, std::move(message)); }

// The core names options by the tools' flags ("--chunk must be positive"); the C API's names are the fields of its
// option structs: "--chunk" becomes "options->chunk", "--lora_rank" "options->rank" (sg_lora_options), "--x=v"
// "options->x = v", "--dtype" "argument 'dtype'". Other "--" words (e.g. a build flag) stay.
std::string FieldMessage(absl::string_view message) {
  static const char* const kFields[] = {
      "strategy", "chunk", "page_size", "lm_chunk", "spaco_budget", "spaco_cap", "seed", "objective", "dpo_beta",
      "grpo_clip_eps", "grpo_kl_beta", "adjoint_form", "adjoint_window", "lr_schedule", "warmup_steps", "min_lr",
      "total_steps", "grad_accum", "sparse_pages", "offload", "lr", "beta1", "beta2", "eps", "weight_decay",
      "clip_grad_norm", "tp", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"};
  std::string out;
  size_t i = 0;
  while (i < message.size()) {
    const size_t dash = message.find("--", i);
    if (dash == absl::string_view::npos) break;
    size_t end = dash + 2;
    while (end < message.size() && (absl::ascii_isalnum(message[end]) || message[end] == '_')) ++end;
    const absl::string_view name = message.substr(dash + 2, end - dash - 2);
    absl::StrAppend(&out, message.substr(i, dash - i));
    i = end;
    if (name == "model" && end < message.size() && message[end] == '=') {  // a hint naming a preset
      absl::StrAppend(&out, "preset ");
      ++i;
      continue;
    }
    if (name == "dtype") {  // the argument of sg_model_create_preset / sg_model_load
      absl::StrAppend(&out, "argument 'dtype'");
      if (end < message.size() && message[end] == '=') {
        absl::StrAppend(&out, " = ");
        ++i;
      }
      continue;
    }
    bool known = false;
    for (const char* f : kFields) known |= name == f;
    if (!known) {
      absl::StrAppend(&out, message.substr(dash, end - dash));
      continue;
    }
    absl::StrAppend(&out, "options->", absl::StartsWith(name, "lora_") ? name.substr(5) : name);
    if (end < message.size() && message[end] == '=') {
      absl::StrAppend(&out, " = ");
      ++i;
    }
  }
  absl::StrAppend(&out, message.substr(std::min(i, message.size())));
  return out;
}

sg_status* FromAbsl(const absl::Status& s) {
  if (s.ok()) return nullptr;
  return MakeStatus(static_cast<int>(s.code()), FieldMessage(s.message()));
}
// A core status with the C function's name in front.
sg_status* FromAbslIn(const char* fn, const absl::Status& s) {
  if (s.ok()) return nullptr;
  return MakeStatus(static_cast<int>(s.code()), absl::StrCat(fn, ": ", FieldMessage(s.message())));
}
sg_status* NullArg(const char* fn, const char* arg) {
  return Invalid(absl::StrCat(fn, ": argument '", arg, "' is NULL"));
}
// NULL when `path` (argument `arg`) is a directory; NOT_FOUND for another kind of file; when stat fails, the code of
// its errno (sg::ErrnoCode, as everywhere: ENOENT NOT_FOUND, ENOTDIR FAILED_PRECONDITION, ...).
sg_status* CheckDirectory(const char* fn, const char* arg, const char* path) {
  const std::string what = absl::StrCat(fn, ": argument '", arg, "' ('", path, "') is not a directory");
  struct stat st;
  if (stat(path, &st) != 0) return FromAbsl(sg::ErrnoStatus(errno, what));
  if (!S_ISDIR(st.st_mode)) return MakeStatus(SG_ERR_NOT_FOUND, what);
  return nullptr;
}

// Runs f, turning exceptions into statuses: out of memory is RESOURCE_EXHAUSTED with the bytes asked and
// available, an I/O error its errno's code, anything else INTERNAL naming fn.
template <typename F>
sg_status* Guard(const char* fn, F&& f) {
  try {
    return f();
  } catch (...) {
    try {
      return FromAbsl(sg::StatusOfCurrentException(fn));
    } catch (...) {
      return OutOfMemoryStatus();
    }
  }
}

sg_status* ParseDType(const char* fn, const char* name, sg::DType* out) {
  const std::string s = name ? name : "f32";
  if (s == "f32" || s == "float32") *out = sg::DType::kF32;
  else if (s == "f64" || s == "float64") *out = sg::DType::kF64;
  else if (s == "bf16" || s == "bfloat16") *out = sg::DType::kBF16;  // bf16 weights over f32 compute (docs/bf16.md)
  else return Invalid(absl::StrCat(fn, ": argument 'dtype' is '", s, "'; supported: f32, f64, bf16"));
  return nullptr;
}

}  // namespace

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
  std::shared_ptr<ModelCore> reference;  // NULL: none; kept alive here while `trainer` points to it
  std::unique_ptr<sg::cabi::TensorParallelRun> tp;  // options.tp > 1: the job and this rank's blocks (`trainer`'s)
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

namespace {

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

sg_status* Busy(const char* fn) {
  return MakeStatus(SG_ERR_BUSY, absl::StrCat(fn, ": the trainer (or its model) is in use by another call; "
                                                   "a trainer runs one step at a time"));
}

// Sizes of the size-versioned structs in older headers: programs built against them pass these. Their layouts are
// frozen; later fields are appended. (sg_metrics did not change in 0.3: its 0.2 size is also the 0.3 size.)
constexpr size_t kTrainerOptionsSize0_1 = offsetof(sg_trainer_options, spaco_budget);
constexpr size_t kTrainerOptionsSize0_2 = offsetof(sg_trainer_options, objective);
constexpr size_t kTrainerOptionsSize0_3 = offsetof(sg_trainer_options, adjoint_form);
constexpr size_t kTrainerOptionsSize0_4 = offsetof(sg_trainer_options, lr_schedule);
constexpr size_t kTrainerOptionsSize0_5 = offsetof(sg_trainer_options, sparse_pages);
constexpr size_t kMetricsSize0_1 = offsetof(sg_metrics, chunks);
constexpr size_t kMetricsSize0_3 = offsetof(sg_metrics, adjoint_pairs);  // = the 0.2 size
constexpr size_t kMetricsSize0_4 = offsetof(sg_metrics, lr);
constexpr size_t kMetricsSize0_6 = offsetof(sg_metrics, peak_bytes_master_weights);  // = the 0.5 size
constexpr size_t kParamInfoSize0_6 = offsetof(sg_param_info, on_device);
constexpr size_t kTrainerOptionsSize0_6 = offsetof(sg_trainer_options, tp);  // = 0.7 before tp
constexpr size_t kMetricsSize0_7 = offsetof(sg_metrics, tp);                 // 0.7 before tp
constexpr size_t kTrainerOptionsSize0_7 = offsetof(sg_trainer_options, grpo_kl_bias_correction);  // 0.7 with tp
static_assert(kTrainerOptionsSize0_1 == 216 && kMetricsSize0_1 == 184, "the 0.1 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_2 == 240 && kMetricsSize0_3 == 200, "the 0.2 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_3 == 272, "the 0.3 (LP64) layout changed: append only");
static_assert(kTrainerOptionsSize0_4 == 288 && kMetricsSize0_4 == 208, "the 0.4 (LP64) layouts changed: append only");
static_assert(kTrainerOptionsSize0_5 == 328 && kMetricsSize0_6 == 224 && sizeof(sg_lora_options) == 48 &&
                  sizeof(sg_eval_result) == 1616,
              "the 0.5 (LP64) layouts changed: append only");
static_assert(kMetricsSize0_7 == 240, "the 0.7 (LP64) sg_metrics changed: append only");
static_assert(kTrainerOptionsSize0_6 == 344, "the 0.6 (LP64) layout changed: append only (0.7 renamed "
              "reserved_0_6 to num_threads, the same size)");
static_assert(sizeof(sg_metrics) == 256 && kTrainerOptionsSize0_7 == 352, "the 0.7 (LP64) layouts with tp");
static_assert(sizeof(sg_trainer_options) == 360, "the 0.7 (LP64) layout with grpo_kl_bias_correction");

struct PublishedSize {
  const char* version;
  size_t size;
};

// A struct_size is accepted when it is a published version's (`older`) or at least this library's.
sg_status* CheckStructSize(const char* fn, const char* arg, size_t got, size_t want,
                           std::initializer_list<PublishedSize> older = {}) {
  if (got >= want) return nullptr;
  std::string sizes;
  for (const PublishedSize& p : older) {
    if (got == p.size) return nullptr;
    absl::StrAppend(&sizes, sizes.empty() ? " and not the " : " or the ", p.version, " size ", p.size);
  }
  return Invalid(absl::StrCat(fn, ": ", arg, "->struct_size is ", got, ", smaller than this library's ", want, sizes,
                              " (initialise it with the matching *_init()/*_default_options())"));
}

sg_status* CheckMetrics(const char* fn, const sg_metrics* out) {
  if (!out) return nullptr;
  return CheckStructSize(fn, "out", out->struct_size, sizeof(sg_metrics),
                         {{"0.1", kMetricsSize0_1},
                          {"0.3", kMetricsSize0_3},
                          {"0.4", kMetricsSize0_4},
                          {"0.6", kMetricsSize0_6},
                          {"0.7 (before tp)", kMetricsSize0_7}});
}

// The memory is that of the trained model: this rank's blocks under tensor parallelism.
void FillMetrics(const sg::StepMetrics& m, const sg_trainer* t, double seconds, sg_metrics* out) {
  if (!out) return;
  const int64_t step = t->trainer->step();
  const sg::MemorySnapshot snap = t->trainer->model().memory().Snapshot();
  out->loss = m.loss;
  out->tokens = m.tokens;
  out->grad_norm = m.grad_norm;
  out->step = step;
  out->peak_bytes = snap.total_peak;
  for (int i = 0; i < SG_NUM_MEMORY_CATEGORIES; ++i) {
    out->peak_bytes_by_category[i] = snap.peak[i];
    out->bytes_at_peak_by_category[i] = snap.at_total_peak[i];
  }
  out->seconds = seconds;
  if (out->struct_size > kMetricsSize0_1) {
    out->chunks = m.chunks;
    out->chunks_backpropagated = m.chunks_backpropagated;
  }
  if (out->struct_size > kMetricsSize0_3) out->adjoint_pairs = m.adjoint_pairs;
  if (out->struct_size > kMetricsSize0_4) {
    out->lr = m.lr;
    out->micro_batches = m.micro_batches;
  }
  if (out->struct_size > kMetricsSize0_6) {
    out->peak_bytes_master_weights = snap.peak[SG_MEMORY_CATEGORY_MASTER_WEIGHTS];
    out->bytes_at_peak_master_weights = snap.at_total_peak[SG_MEMORY_CATEGORY_MASTER_WEIGHTS];
  }
  if (out->struct_size > kMetricsSize0_7) {
    out->tp = t->tp ? t->tp->grid.tp->size() : 1;
    out->tp_bytes_reduced = t->tp ? t->tp->bytes_last_call : 0;
  }
}

// Tensor parallel: the handle's whole values (which the caller may have written) into this rank's blocks, before a
// call of the trainer.
absl::Status TakeHandleValues(sg_trainer* t) {
  if (!t->tp) return absl::OkStatus();
  t->tp->split->memory().set_limit(t->core->model->memory().limit());
  return sg::ScatterParams(*t->core->model, *t->tp->split);
}
// ... and after it the group's blocks gathered into the handle (collective), so that it shows the whole model.
absl::Status ShowWholeModel(sg_trainer* t, bool grads, bool values) {
  if (!t->tp) return absl::OkStatus();
  if (grads)
    if (absl::Status s = sg::GatherGrads(*t->tp->split, *t->core->model); !s.ok()) return s;
  if (values) return sg::GatherParams(*t->tp->split, *t->core->model);
  return absl::OkStatus();
}
int64_t TpBytes(const sg_trainer* t) { return t->tp ? t->tp->grid.tp->bytes_communicated() : 0; }

// Tensor parallel: before the collective part of a call, every rank learns whether all got there; `local` is this
// rank's verdict (NULL = ready). A rank that failed returns its own error, the others one naming it, so no rank waits
// in a collective another skipped (a bad argument on one rank fails every rank at once).
sg_status* Agree(const char* fn, sg_trainer* t, sg_status* local) {
  if (!t->tp || t->agreed) return local;
  t->agreed = true;
  const absl::Status all =
      sg::cabi::AgreeAcrossRanks(*t->tp->world, local ? absl::AbortedError("failed") : absl::OkStatus());
  return local ? local : FromAbslIn(fn, all);
}

// Runs a trainer call `f` (-> sg_status*) that calls Agree before its collective part; a failure before it agrees.
template <typename F>
sg_status* Agreed(const char* fn, sg_trainer* t, F&& f) {
  if (t) t->agreed = false;
  sg_status* s = f();
  return t ? Agree(fn, t, s) : s;
}

void Report(sg_trainer* t, const sg::StepMetrics& m, int phase) {
  if (!t->progress) return;
  sg_progress p;
  p.struct_size = sizeof(sg_progress);
  p.step = t->trainer->step();
  p.loss = m.loss;
  p.tokens = m.tokens;
  p.grad_norm = m.grad_norm;
  p.phase = phase;
  t->progress(t->progress_user, &p);  // a C callback: must not throw
}

// The engine's sequence of one C API sequence of n tokens, whose labels follow Hugging Face: aligned with ids (hf
// NULL: next-token labels, hf = ids). Its inputs are ids[0, n - 1), position t predicting hf[t + 1]: the last token
// is only a label, as in the JSONL path, so transformers' len(input_ids), from which dynamic RoPE scales, is n
// (TransformerModel::TokensOfSequence). n = 1 leaves no position: empty.
sg::Sequence EngineSequence(const int32_t* ids, const int32_t* hf, int64_t n) {
  const int32_t* src = hf ? hf : ids;
  sg::Sequence q;
  q.ids.assign(ids, ids + n - 1);
  q.labels.assign(src + 1, src + n);
  return q;
}

// The sequences with positions: the engine refuses empty ones (C API sequences of one token).
std::vector<sg::Sequence> WithPositions(std::vector<sg::Sequence> batch) {
  batch.erase(std::remove_if(batch.begin(), batch.end(), [](const sg::Sequence& q) { return q.ids.empty(); }),
              batch.end());
  return batch;
}

// Builds the batch from the flat arrays (one engine sequence per C sequence, empty for one token), checking each
// argument; a batch without any label is refused unless allow_unlabelled.
sg_status* BuildBatch(const char* fn, int64_t vocab, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                      const int64_t* lengths, int64_t num_sequences, std::vector<sg::Sequence>* batch,
                      bool allow_unlabelled = false) {
  if (!ids) return NullArg(fn, "ids");
  if (!lengths) return NullArg(fn, "lengths");
  if (num_sequences <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_sequences' is ", num_sequences, "; need at least 1 sequence"));
  if (num_tokens <= 0) return Invalid(absl::StrCat(fn, ": argument 'num_tokens' is ", num_tokens, "; need >= 1"));
  for (int64_t i = 0; i < num_sequences; ++i)  // all of them before the sum, which a negative one would hide
    if (lengths[i] <= 0)
      return Invalid(absl::StrCat(fn, ": lengths[", i, "] is ", lengths[i], "; every sequence needs >= 1 token"));
  int64_t sum = 0;  // <= num_tokens: never overflows
  for (int64_t i = 0; i < num_sequences; ++i) {
    if (lengths[i] > num_tokens - sum)
      return Invalid(absl::StrCat(fn, ": argument 'lengths' sums to more than 'num_tokens' (", num_tokens,
                                  ") at lengths[", i, "] = ", lengths[i]));
    sum += lengths[i];
  }
  if (sum != num_tokens)
    return Invalid(absl::StrCat(fn, ": argument 'lengths' sums to ", sum, " but 'num_tokens' is ", num_tokens));
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab)
      return Invalid(absl::StrCat(fn, ": ids[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")"));
    if (labels && labels[i] != -100 && (labels[i] < 0 || labels[i] >= vocab))
      return Invalid(absl::StrCat(fn, ": labels[", i, "] = ", labels[i], " is neither -100 nor in [0, ", vocab,
                                  ")"));
  }
  batch->resize(num_sequences);
  int64_t off = 0;
  bool any_label = false;
  for (int64_t s = 0; s < num_sequences; ++s) {
    sg::Sequence& q = (*batch)[s];
    const int64_t n = lengths[s];
    q = EngineSequence(ids + off, labels ? labels + off : nullptr, n);
    for (int32_t l : q.labels) any_label |= l >= 0;
    off += n;
  }
  if (!any_label && !allow_unlabelled)
    return Invalid(absl::StrCat(fn, labels ? ": argument 'labels' has no label (not -100) at a position >= 1 of any "
                                             "sequence (position 0 is never predicted)"
                                           : ": every sequence has length 1, so there are no next-token labels",
                                "; the loss is undefined"));
  return nullptr;
}

enum class Call { kGradients, kStep, kEvaluate, kAccumulate, kScore };

sg_status* WrongObjective(const char* fn, const sg_trainer* t, const char* needs, const char* use) {
  return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                    absl::StrCat(fn, ": the trainer's objective is '", t->objective.name, "'; this call needs '", needs,
                                 "' (options->objective)", use[0] ? absl::StrCat("; use ", use) : ""));
}

// The first optimizer step allocates AdamW's two moments per trained parameter. Checked up front against the memory
// limit: the core would fail halfway through that allocation and keep the moments it got.
sg_status* CheckOptimizerMemory(const char* fn, sg_trainer* t) {
  sg::Model& model = t->trainer->model();
  const int64_t limit = model.memory().limit();
  if (limit <= 0 || t->trainer->step() > 0) return nullptr;
  int64_t need = 0;
  for (const sg::Param& p : model.params())
    if (p.grad.defined()) need += 2 * static_cast<int64_t>(p.value.nbytes());
  const int64_t in_use = model.memory().Snapshot().total_current;
  if (in_use + need <= limit) return nullptr;
  return MakeStatus(SG_ERR_RESOURCE_EXHAUSTED,
                    absl::StrCat(fn, ": memory limit of ", limit, " bytes exceeded: the optimizer's moments need ",
                                 need, " bytes with ", in_use, " in use"));
}

// Runs `compute` (-> absl::StatusOr<sg::StepMetrics>) with the trainer's model marked busy, and its reference too
// when `with_reference`; `check` (-> sg_status*, NULL = fine) first looks at what that guards (the reference).
// kGradients/kStep report progress and keep the metrics for optimizer_step; kStep then clips and applies AdamW.
template <typename Check, typename Compute>
sg_status* Run(const char* fn, sg_trainer* t, Call call, bool with_reference, sg_metrics* out, Check&& check,
               Compute&& compute) {
  ModelCore& core = *t->core;
  BusyGuard guard(core);
  if (!guard.acquired()) return Agree(fn, t, Busy(fn));
  std::unique_ptr<BusyGuard> reference_guard;
  if (with_reference && t->reference) {
    reference_guard = std::make_unique<BusyGuard>(*t->reference);
    if (!reference_guard->acquired())
      return Agree(fn, t, MakeStatus(SG_ERR_BUSY, absl::StrCat(fn, ": the trainer's reference model is in use by another call")));
  }
  if (sg_status* s = check()) return Agree(fn, t, s);
  if (t->cancel.exchange(false)) return Agree(fn, t, MakeStatus(SG_ERR_CANCELLED, absl::StrCat(fn, ": cancelled")));
  if (sg_status* s = Agree(fn, t, nullptr)) return s;
  sg::ScopedThreads threads(t->trainer->num_threads());
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = TakeHandleValues(t); !s.ok()) return FromAbslIn(fn, s);
  t->trainer->model().memory().ResetPeak();
  const int64_t bytes_before = TpBytes(t);
  absl::StatusOr<sg::StepMetrics> m = compute();
  if (!m.ok()) {
    if (m.status().code() == absl::StatusCode::kCancelled) t->cancel.store(false);
    return FromAbsl(m.status());
  }
  if (call != Call::kEvaluate) {
    t->last = *m;
    Report(t, *m, 0);
  }
  if (call == Call::kStep) {
    if (t->cancel.exchange(false)) return MakeStatus(SG_ERR_CANCELLED, absl::StrCat(fn, ": cancelled"));
    if (sg_status* s = CheckOptimizerMemory(fn, t)) return s;
    if (absl::Status s = t->trainer->OptimizerStep(&*m); !s.ok()) return FromAbsl(s);
  } else {  // no optimizer step in this call
    m->lr = 0;
    m->micro_batches = 0;
  }
  if (t->tp) t->tp->bytes_last_call = TpBytes(t) - bytes_before;
  if (absl::Status s = ShowWholeModel(t, call != Call::kEvaluate, call == Call::kStep); !s.ok())
    return FromAbslIn(fn, s);
  if (call == Call::kStep) Report(t, *m, 1);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  FillMetrics(*m, t, secs, out);
  return nullptr;
}

// sg_trainer_score's body: per sequence the engine's log-probs (position t: of label t + 1) written one entry later,
// at the label they belong to; NaN at each sequence's position 0 and where there is no label.
absl::StatusOr<sg::StepMetrics> Score(sg::Trainer& trainer, const std::vector<sg::Sequence>& batch,
                                      double* logprobs) {
  sg::StepMetrics m;
  double sum = 0;
  for (const sg::Sequence& q : batch) {
    logprobs[0] = NAN;
    if (!q.ids.empty()) {
      absl::StatusOr<std::vector<double>> lp = trainer.TokenLogprobs(trainer.model(), q);
      if (!lp.ok()) return lp.status();
      for (size_t t = 0; t < q.ids.size(); ++t) {
        logprobs[t + 1] = q.labels[t] >= 0 ? (*lp)[t] : NAN;
        if (q.labels[t] < 0) continue;
        sum += (*lp)[t];
        ++m.tokens;
      }
    }
    logprobs += q.ids.size() + 1;
  }
  m.loss = m.tokens > 0 ? -sum / static_cast<double>(m.tokens) : NAN;
  return m;
}

// Shared body of compute_gradients / step / evaluate / accumulate_gradients / score (which writes `logprobs`).
sg_status* RunStepOn(const char* fn, sg_trainer* t, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                   const int64_t* lengths, int64_t num_sequences, sg_metrics* out, Call call,
                   double* logprobs = nullptr) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  const bool forward_only = call == Call::kEvaluate || call == Call::kScore;
  if (call == Call::kScore && !logprobs) return NullArg(fn, "logprobs");
  if (!forward_only && t->objective.name != "sft")
    return WrongObjective(fn, t, "sft", t->objective.name == "dpo" ? "sg_trainer_step_dpo / compute_gradients_dpo"
                                                                    : "sg_trainer_step_grpo / compute_gradients_grpo");
  std::vector<sg::Sequence> batch;
  if (sg_status* s = BuildBatch(fn, t->core->model->vocab_size(), ids, labels, num_tokens, lengths, num_sequences,
                                &batch, call == Call::kScore))
    return s;
  sg::Trainer& trainer = *t->trainer;
  return Run(fn, t, forward_only ? Call::kEvaluate : call, false, out, [] { return static_cast<sg_status*>(nullptr); },
             [&]() -> absl::StatusOr<sg::StepMetrics> {
               if (call == Call::kScore) return Score(trainer, batch, logprobs);
               if (call == Call::kEvaluate) return trainer.EvaluateLoss(WithPositions(std::move(batch)));
               sg::Batch whole;
               whole.sequences = WithPositions(std::move(batch));
               return sg::cabi::Gradients(trainer, t->tp.get(), whole, call == Call::kAccumulate);
             });
}

// Sequence i of pointer arrays (ids[i], labels[i] of lengths[i] tokens), checked; the names are the C arguments'.
struct SequenceArgs {
  const char* ids_name;
  const char* labels_name;
  const char* lengths_name;
  const int32_t* const* ids;
  const int32_t* const* labels;  // NULL or entries NULL: next-token labels
  const int64_t* lengths;
};

sg_status* BuildSequence(const char* fn, int64_t vocab, const SequenceArgs& a, int64_t i, sg::Sequence* out) {
  const int32_t* ids = a.ids[i];
  const int32_t* labels = a.labels ? a.labels[i] : nullptr;
  const int64_t n = a.lengths[i];
  if (n <= 0)
    return Invalid(absl::StrCat(fn, ": ", a.lengths_name, "[", i, "] is ", n, "; every sequence needs >= 1 token"));
  if (!ids) return Invalid(absl::StrCat(fn, ": argument '", a.ids_name, "[", i, "]' is NULL"));
  for (int64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= vocab)
      return Invalid(absl::StrCat(fn, ": ", a.ids_name, "[", i, "][", k, "] = ", ids[k],
                                  " is outside the vocabulary [0, ", vocab, ")"));
    if (labels && labels[k] != -100 && (labels[k] < 0 || labels[k] >= vocab))
      return Invalid(absl::StrCat(fn, ": ", a.labels_name, "[", i, "][", k, "] = ", labels[k],
                                  " is neither -100 nor in [0, ", vocab, ")"));
  }
  *out = EngineSequence(ids, labels, n);
  for (int32_t l : out->labels)
    if (l >= 0) return nullptr;
  if (labels)
    return Invalid(absl::StrCat(fn, ": ", a.labels_name, "[", i, "] has no label (not -100) at a position >= 1 "
                                "(position 0 is never predicted); the loss is undefined"));
  return Invalid(absl::StrCat(fn, ": ", a.lengths_name, "[", i,
                              "] is 1, so there are no next-token labels; the loss is undefined"));
}

sg_status* RunDpoOn(const char* fn, sg_trainer* t, const int32_t* const* chosen_ids,
                  const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                  const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                  const int64_t* rejected_lengths, const double* ref_chosen_logp, const double* ref_rejected_logp,
                  int64_t num_pairs, sg_metrics* out, Call call) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  if (t->objective.name != "dpo")
    return WrongObjective(fn, t, "dpo", t->objective.name == "sft" ? "sg_trainer_step / compute_gradients"
                                                                   : "sg_trainer_step_grpo / compute_gradients_grpo");
  if (!chosen_ids) return NullArg(fn, "chosen_ids");
  if (!chosen_lengths) return NullArg(fn, "chosen_lengths");
  if (!rejected_ids) return NullArg(fn, "rejected_ids");
  if (!rejected_lengths) return NullArg(fn, "rejected_lengths");
  if (num_pairs <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_pairs' is ", num_pairs, "; need at least 1 pair"));
  const int64_t vocab = t->core->model->vocab_size();
  const SequenceArgs chosen{"chosen_ids", "chosen_labels", "chosen_lengths", chosen_ids, chosen_labels,
                            chosen_lengths};
  const SequenceArgs rejected{"rejected_ids", "rejected_labels", "rejected_lengths", rejected_ids, rejected_labels,
                              rejected_lengths};
  sg::Batch batch;
  batch.pairs.resize(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    sg::DpoPair& p = batch.pairs[i];
    if (sg_status* s = BuildSequence(fn, vocab, chosen, i, &p.chosen)) return s;
    if (sg_status* s = BuildSequence(fn, vocab, rejected, i, &p.rejected)) return s;
    const double* refs[2] = {ref_chosen_logp, ref_rejected_logp};
    const char* names[2] = {"ref_chosen_logp", "ref_rejected_logp"};
    double* dst[2] = {&p.ref_chosen_logp, &p.ref_rejected_logp};
    for (int k = 0; k < 2; ++k) {
      if (!refs[k]) continue;  // NaN: the reference model's
      if (std::isinf(refs[k][i]))
        return Invalid(absl::StrCat(fn, ": ", names[k], "[", i, "] is ", refs[k][i],
                                    "; need a finite log-prob sum, or NaN for the reference model's"));
      *dst[k] = refs[k][i];
    }
  }
  // Under the busy guard, where the reference cannot change: pairs without reference log-probs need the model.
  auto check = [&]() -> sg_status* {
    if (t->trainer->has_reference()) return nullptr;
    for (int64_t i = 0; i < num_pairs; ++i) {
      const sg::DpoPair& p = batch.pairs[i];
      for (int k = 0; k < 2; ++k) {
        if (!std::isnan(k == 0 ? p.ref_chosen_logp : p.ref_rejected_logp)) continue;
        const double* ref = k == 0 ? ref_chosen_logp : ref_rejected_logp;
        const char* name = k == 0 ? "ref_chosen_logp" : "ref_rejected_logp";
        return Invalid(absl::StrCat(fn, ": ", ref ? absl::StrCat(name, "[", i, "] is NaN")
                                                  : absl::StrCat("argument '", name, "' is NULL"),
                                    " (pair ", i, " has no reference log-prob) and the trainer has no reference "
                                    "model (sg_trainer_set_reference)"));
      }
    }
    return nullptr;
  };
  sg::Trainer& trainer = *t->trainer;
  return Run(fn, t, call, true, out, check,
             [&] { return sg::cabi::Gradients(trainer, t->tp.get(), batch, call == Call::kAccumulate); });
}

sg_status* RunGrpoOn(const char* fn, sg_trainer* t, const int32_t* const* ids, const int32_t* const* labels,
                   const int64_t* lengths, const double* advantages, const double* const* old_logprobs,
                   const double* const* ref_logprobs, int64_t num_completions, const int64_t* group_offsets,
                   int64_t num_groups, sg_metrics* out, Call call) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  if (t->objective.name != "grpo")
    return WrongObjective(fn, t, "grpo", t->objective.name == "sft" ? "sg_trainer_step / compute_gradients"
                                                                    : "sg_trainer_step_dpo / compute_gradients_dpo");
  if (!ids) return NullArg(fn, "ids");
  if (!lengths) return NullArg(fn, "lengths");
  if (!advantages) return NullArg(fn, "advantages");
  if (!group_offsets) return NullArg(fn, "group_offsets");
  if (num_completions <= 0)
    return Invalid(
        absl::StrCat(fn, ": argument 'num_completions' is ", num_completions, "; need at least 1 completion"));
  if (num_groups <= 0)
    return Invalid(absl::StrCat(fn, ": argument 'num_groups' is ", num_groups, "; need at least 1 group"));
  if (group_offsets[0] != 0)
    return Invalid(absl::StrCat(fn, ": group_offsets[0] is ", group_offsets[0], "; must be 0"));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t begin = group_offsets[g], end = group_offsets[g + 1];
    if (end == begin)
      return Invalid(absl::StrCat(fn, ": argument 'group_offsets': group ", g, " has no completions (G = 0): ",
                                  "group_offsets[", g, "] = group_offsets[", g + 1, "] = ", end));
    if (end < begin)
      return Invalid(absl::StrCat(fn, ": group_offsets[", g + 1, "] = ", end, " is less than group_offsets[", g,
                                  "] = ", begin, "; offsets must increase"));
    if (end > num_completions)
      return Invalid(absl::StrCat(fn, ": group_offsets[", g + 1, "] = ", end, " is beyond 'num_completions' = ",
                                  num_completions));
  }
  if (group_offsets[num_groups] != num_completions)
    return Invalid(absl::StrCat(fn, ": group_offsets[", num_groups, "] = ", group_offsets[num_groups],
                                " but 'num_completions' is ", num_completions, "; the groups must cover every "
                                "completion"));
  const int64_t vocab = t->core->model->vocab_size();
  const SequenceArgs seqs{"ids", "labels", "lengths", ids, labels, lengths};
  sg::Batch batch;
  batch.groups.resize(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t c = group_offsets[g]; c < group_offsets[g + 1]; ++c) {
      sg::GrpoCompletion& comp = batch.groups[g].completions.emplace_back();
      if (sg_status* s = BuildSequence(fn, vocab, seqs, c, &comp.seq)) return s;
      if (!std::isfinite(advantages[c]))
        return Invalid(absl::StrCat(fn, ": advantages[", c, "] is ", advantages[c], "; need a finite advantage"));
      comp.advantage = advantages[c];
      const double* const* arrays[2] = {old_logprobs, ref_logprobs};
      const char* names[2] = {"old_logprobs", "ref_logprobs"};
      std::vector<double>* dst[2] = {&comp.old_logprobs, &comp.ref_logprobs};
      for (int k = 0; k < 2; ++k) {
        const double* lp = arrays[k] ? arrays[k][c] : nullptr;
        if (!lp) continue;  // absent
        // Given aligned with the C API's labels (entry t for label t); the engine's position t - 1 predicts it.
        const int64_t n = lengths[c];
        dst[k]->assign(n - 1, NAN);
        for (int64_t pos = 0; pos + 1 < n; ++pos) {
          if (comp.seq.labels[pos] < 0) continue;
          if (!std::isfinite(lp[pos + 1]))
            return Invalid(absl::StrCat(fn, ": ", names[k], "[", c, "][", pos + 1, "] is ", lp[pos + 1], " (group ",
                                        g, ") where the label is ", comp.seq.labels[pos],
                                        "; need a finite log-prob at every labelled position"));
          (*dst[k])[pos] = lp[pos + 1];
        }
      }
    }
  }
  // Under the busy guard: completions without reference log-probs need the reference model for the KL term.
  auto check = [&]() -> sg_status* {
    if (t->trainer->has_reference() || !(t->objective.grpo_kl_beta > 0)) return nullptr;
    for (int64_t g = 0; g < num_groups; ++g)
      for (int64_t c = group_offsets[g]; c < group_offsets[g + 1]; ++c) {
        if (!batch.groups[g].completions[c - group_offsets[g]].ref_logprobs.empty()) continue;
        return Invalid(absl::StrCat(fn, ": ", ref_logprobs ? absl::StrCat("ref_logprobs[", c, "] is NULL")
                                                           : std::string("argument 'ref_logprobs' is NULL"),
                                    " (group ", g, " completion ", c - group_offsets[g], "), grpo_kl_beta = ",
                                    t->objective.grpo_kl_beta, " > 0 needs reference log-probs, and the trainer "
                                    "has no reference model (sg_trainer_set_reference)"));
      }
    return nullptr;
  };
  sg::Trainer& trainer = *t->trainer;
  return Run(fn, t, call, true, out, check,
             [&] { return sg::cabi::Gradients(trainer, t->tp.get(), batch, call == Call::kAccumulate); });
}

// The trainer calls, agreeing across tensor-parallel ranks (Agreed).
template <typename... A>
sg_status* RunStep(const char* fn, sg_trainer* t, A... a) {
  return Agreed(fn, t, [&] { return RunStepOn(fn, t, a...); });
}
template <typename... A>
sg_status* RunDpo(const char* fn, sg_trainer* t, A... a) {
  return Agreed(fn, t, [&] { return RunDpoOn(fn, t, a...); });
}
template <typename... A>
sg_status* RunGrpo(const char* fn, sg_trainer* t, A... a) {
  return Agreed(fn, t, [&] { return RunGrpoOn(fn, t, a...); });
}

// The family's default LoRA targets (as examples:train's --lora_targets default).
std::string DefaultLoraTargets(const sg::Model& m) { return sg::DefaultLoraTargets(m.family()); }

// Under core.mu: LoRA changes the parameters, which the optimizer state of an existing trainer would not match.
sg_status* CheckLoraCanBeEnabled(const char* fn, const ModelCore& core) {
  if (core.model->lora())
    return MakeStatus(SG_ERR_FAILED_PRECONDITION, absl::StrCat(fn, ": LoRA is already enabled on this model"));
  if (core.trainers > 0)
    return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                      absl::StrCat(fn, ": the model has ", core.trainers, core.trainers == 1 ? " trainer" : " trainers",
                                   "; enable LoRA before creating trainers (their optimizer state would not match "
                                   "the adapters)"));
  return nullptr;
}

// Loads a checkpoint directory into the trainer (its busy guard held), refusing a differing run configuration.
sg_status* LoadInto(const char* fn, sg_trainer* t, const char* dir, int64_t* step, int64_t* data_position) {
  if (sg_status* s = Agree(fn, t, nullptr)) return s;
  std::optional<sg::dist::WholeTrainer> whole;  // tensor parallel: the checkpoint holds the whole model
  if (t->tp) {
    absl::StatusOr<sg::dist::WholeTrainer> w = sg::dist::MakeWholeTrainer(*t->trainer, sg::Device::kCPU);
    if (!w.ok()) return FromAbslIn(fn, w.status());
    whole = std::move(*w);
  }
  sg::Trainer& trainer = whole ? *whole->trainer : *t->trainer;
  const sg::RunConfig expected = sg::TrainerRunConfig(trainer);
  absl::StatusOr<sg::CheckpointMeta> meta = sg::LoadCheckpoint(dir, trainer, &expected);
  if (t->tp) {  // every rank loads it; all restore, or none
    if (absl::Status s = sg::cabi::AgreeAcrossRanks(*t->tp->world, meta.status()); !s.ok()) return FromAbslIn(fn, s);
    if (absl::Status s = sg::dist::ScatterTrainer(trainer, *t->trainer); !s.ok()) return FromAbslIn(fn, s);
    if (absl::Status s = ShowWholeModel(t, false, true); !s.ok()) return FromAbslIn(fn, s);
  }
  if (!meta.ok()) return FromAbslIn(fn, meta.status());
  // The header promises these on stderr: the load succeeded, but the run is no longer bit-exact.
  for (const std::string& w : meta->warnings) std::fprintf(stderr, "seqgrad: warning: %s: %s: %s\n", fn, dir, w.c_str());
  t->last = sg::StepMetrics{};
  if (step) *step = meta->trainer.step;
  if (data_position) *data_position = meta->data_position;
  return nullptr;
}

// Every family's presets: transformers first, then Mamba.
std::vector<std::string> AllPresetNames() {
  std::vector<std::string> names = sg::TransformerPresetNames();
  for (const std::string& n : sg::MambaPresetNames()) names.push_back(n);
  return names;
}

}  // namespace

extern "C" {

const char* sg_version(void) { return kVersion; }

int sg_status_code(const sg_status* status) { return status ? status->code : SG_OK; }
const char* sg_status_message(const sg_status* status) { return status ? status->message.c_str() : ""; }
void sg_status_free(sg_status* status) {
  if (status != OutOfMemoryStatus()) delete status;
}

const char* sg_code_name(int code) {
  switch (code) {
    case SG_OK: return "OK";
    case SG_ERR_CANCELLED: return "CANCELLED";
    case SG_ERR_UNKNOWN: return "UNKNOWN";
    case SG_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case SG_ERR_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case SG_ERR_NOT_FOUND: return "NOT_FOUND";
    case SG_ERR_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case SG_ERR_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case SG_ERR_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case SG_ERR_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case SG_ERR_ABORTED: return "ABORTED";
    case SG_ERR_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case SG_ERR_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case SG_ERR_INTERNAL: return "INTERNAL";
    case SG_ERR_UNAVAILABLE: return "UNAVAILABLE";
    case SG_ERR_DATA_LOSS: return "DATA_LOSS";
    case SG_ERR_UNAUTHENTICATED: return "UNAUTHENTICATED";
    case SG_ERR_BUSY: return "BUSY";
  }
  return "UNKNOWN_CODE";
}

const char* sg_dtype_name(int dtype) {
  if (dtype < 0 || dtype > SG_DTYPE_I64) return nullptr;
  return sg::DTypeName(static_cast<sg::DType>(dtype));
}

const char* sg_memory_category_name(int category) {
  static_assert(SG_NUM_MEMORY_CATEGORIES_ALL == sg::kNumMemCategories, "category count changed: extend the C API");
  static_assert(SG_MEMORY_CATEGORY_MASTER_WEIGHTS == static_cast<int>(sg::MemCategory::kMasterWeights));
  if (category < 0 || category >= SG_NUM_MEMORY_CATEGORIES_ALL) return nullptr;
  return sg::MemCategoryName(static_cast<sg::MemCategory>(category));
}

const char* const* sg_model_preset_names(void) {
  // Built once from the core's preset lists; the strings live as long as the library.
  static const std::vector<std::string>* const kStrings = new std::vector<std::string>(AllPresetNames());
  static const std::vector<const char*>* const kNames = [] {
    auto* v = new std::vector<const char*>();
    for (const std::string& n : *kStrings) v->push_back(n.c_str());
    v->push_back(nullptr);
    return v;
  }();
  return kNames->data();
}

// Writes the model's files; under a tensor-parallel trainer rank 0 alone writes (the handle holds the whole model on
// every rank) and every rank returns its status.
static absl::Status SaveWhole(ModelCore& core, const std::function<absl::Status()>& save) {
  std::lock_guard<std::mutex> lock(core.mu);
  if (!core.tp_group) return save();
  return sg::cabi::WriteOnRankZero(*core.tp_group, save);
}

static sg_status* CreateModel(const char* fn, const std::string& spec, const char* dtype, uint64_t seed,
                              bool from_dir, sg_model** out, const char* device = nullptr) {
  sg::DType dt = sg::DType::kF32;
  if (sg_status* s = ParseDType(fn, dtype, &dt)) return s;
  const std::string device_name = device ? device : "cpu";
  absl::StatusOr<sg::Device> dev = sg::ParseDevice(device_name);
  if (!dev.ok() || *dev == sg::Device::kMeta)
    return Invalid(absl::StrCat(fn, ": options->device is '", device_name, "'; supported: cpu, cuda"));
  if (absl::Status usable = sg::CheckDevice(*dev); !usable.ok()) return FromAbslIn(fn, usable);
  absl::StatusOr<std::unique_ptr<sg::Model>> m = sg::LoadAnyModel(spec, dt, seed, *dev);
  if (!m.ok()) return MakeStatus(static_cast<int>(m.status().code()), absl::StrCat(fn, ": ", FieldMessage(m.status().message())));
  auto core = std::make_shared<ModelCore>();
  core->model = std::move(*m);
  if (char* absolute = realpath(spec.c_str(), nullptr)) {  // a directory (a preset name is no path)
    if (from_dir) core->source_dir = absolute;
    free(absolute);
  }
  *out = new sg_model{std::move(core)};
  return nullptr;
}

namespace {
sg_status* CreatePreset(const char* fn, const char* preset, const char* dtype, uint64_t seed, const char* device,
                        sg_model** out) {
  return Guard(fn, [&]() -> sg_status* {
    if (!out) return NullArg(fn, "out");
    *out = nullptr;
    if (!preset) return NullArg(fn, "preset");
    const std::vector<std::string> known = AllPresetNames();
    bool found = false;
    for (const std::string& n : known) found |= n == preset;
    if (!found) {
      std::string names;
      for (const std::string& n : known) absl::StrAppend(&names, names.empty() ? "" : ", ", n);
      return Invalid(absl::StrCat(fn, ": argument 'preset' is '", preset, "'; known presets: ", names));
    }
    return CreateModel(fn, preset, dtype, seed, /*from_dir=*/false, out, device);
  });
}

sg_status* Load(const char* fn, const char* hf_dir, const char* dtype, const char* device, sg_model** out) {
  return Guard(fn, [&]() -> sg_status* {
    if (!out) return NullArg(fn, "out");
    *out = nullptr;
    if (!hf_dir) return NullArg(fn, "hf_dir");
    if (sg_status* s = CheckDirectory(fn, "hf_dir", hf_dir)) return s;
    return CreateModel(fn, hf_dir, dtype, 0, /*from_dir=*/true, out, device);
  });
}

// options (NULL: the defaults) into *o, its struct_size checked.
sg_status* ModelOptions(const char* fn, const sg_model_options* options, sg_model_options* o) {
  *o = sg_model_default_options();
  if (!options) return nullptr;
  if (sg_status* s = CheckStructSize(fn, "options", options->struct_size, sizeof(sg_model_options))) return s;
  o->dtype = options->dtype;
  o->device = options->device;
  o->seed = options->seed;
  return nullptr;
}
}  // namespace

sg_status* sg_model_create_preset(const char* preset, const char* dtype, uint64_t seed, sg_model** out) {
  return CreatePreset("sg_model_create_preset", preset, dtype, seed, nullptr, out);
}

sg_status* sg_model_load(const char* hf_dir, const char* dtype, sg_model** out) {
  return Load("sg_model_load", hf_dir, dtype, nullptr, out);
}

sg_model_options sg_model_default_options(void) {
  sg_model_options o{};
  o.struct_size = sizeof(sg_model_options);
  return o;
}

sg_status* sg_model_create_preset_with(const char* preset, const sg_model_options* options, sg_model** out) {
  static const char fn[] = "sg_model_create_preset_with";
  sg_model_options o;
  if (sg_status* s = ModelOptions(fn, options, &o)) return s;
  return CreatePreset(fn, preset, o.dtype, o.seed, o.device, out);
}

sg_status* sg_model_load_with(const char* hf_dir, const sg_model_options* options, sg_model** out) {
  static const char fn[] = "sg_model_load_with";
  sg_model_options o;
  if (sg_status* s = ModelOptions(fn, options, &o)) return s;
  return Load(fn, hf_dir, o.dtype, o.device, out);
}

const char* sg_model_device(const sg_model* model) {
  if (!model) return "";
  return model->core->model->memory().device() == sg::Device::kCUDA ? "cuda" : "cpu";
}

sg_status* sg_model_save(sg_model* model, const char* dir) {
  static const char fn[] = "sg_model_save";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbsl(SaveWhole(*model->core, [&] { return sg::SaveModel(*model->core->model, dir, model->core->source_dir); }));
  });
}

sg_status* sg_model_save_as(sg_model* model, const char* dir, const char* dtype) {
  static const char fn[] = "sg_model_save_as";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    const std::string what = absl::StrCat(fn, ": argument 'dtype'");
    absl::StatusOr<sg::SaveDType> as = sg::ParseSaveDType(dtype ? dtype : "", what);
    if (!as.ok()) return FromAbsl(as.status());
    if (absl::Status s = sg::CheckSaveDType(*model->core->model, *as, what); !s.ok()) return FromAbsl(s);
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbsl(
        SaveWhole(*model->core, [&] { return sg::SaveModel(*model->core->model, dir, model->core->source_dir, *as); }));
  });
}

void sg_model_free(sg_model* model) { delete model; }

const char* sg_model_family(const sg_model* model) {
  if (!model) return "";
  // Static strings: the C API promises them for the library's lifetime.
  return model->core->model->family() == "ssm" ? "ssm" : "transformer";
}
int64_t sg_model_vocab_size(const sg_model* model) { return model ? model->core->model->vocab_size() : -1; }
int64_t sg_model_num_layers(const sg_model* model) { return model ? model->core->model->num_layers() : -1; }
int64_t sg_model_hidden_size(const sg_model* model) { return model ? model->core->model->hidden_size() : -1; }
int64_t sg_model_num_params(const sg_model* model) {
  return model ? static_cast<int64_t>(model->core->model->params().size()) : -1;
}
int sg_model_dtype(const sg_model* model) { return model ? static_cast<int>(model->core->model->dtype()) : -1; }

sg_status* sg_model_set_memory_limit(sg_model* model, int64_t bytes) {
  static const char fn[] = "sg_model_set_memory_limit";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (bytes < 0) return Invalid(absl::StrCat(fn, ": argument 'bytes' is ", bytes, "; need >= 0 (0 = no limit)"));
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    model->core->model->memory().set_limit(bytes);
    return nullptr;
  });
}

int64_t sg_model_memory_limit(const sg_model* model) { return model ? model->core->model->memory().limit() : -1; }

sg_param_info sg_param_info_init(void) {
  sg_param_info p{};
  p.struct_size = sizeof(sg_param_info);
  return p;
}

sg_status* sg_model_param_info(const sg_model* model, int64_t index, sg_param_info* out) {
  static const char fn[] = "sg_model_param_info";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!out) return NullArg(fn, "out");
    if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_param_info),
                                       {{"0.6", kParamInfoSize0_6}}))
      return s;
    std::vector<sg::Param>& params = model->core->model->params();
    if (index < 0 || index >= static_cast<int64_t>(params.size()))
      return MakeStatus(SG_ERR_OUT_OF_RANGE, absl::StrCat(fn, ": argument 'index' is ", index, "; the model has ",
                                                          params.size(), " parameters"));
    const sg::Param& p = params[index];
    if (p.value.shape().size() > SG_MAX_DIMS)
      return MakeStatus(SG_ERR_UNIMPLEMENTED, absl::StrCat(fn, ": '", p.name, "' has more than 8 dimensions"));
    out->name = p.name.c_str();
    out->dtype = static_cast<int>(p.value.dtype());
    out->ndim = static_cast<int>(p.value.shape().size());
    for (int i = 0; i < SG_MAX_DIMS; ++i) out->shape[i] = i < out->ndim ? p.value.shape()[i] : 0;
    out->numel = p.value.numel();
    out->data = p.value.raw();
    out->grad = p.grad.defined() ? p.grad.raw() : nullptr;
    if (out->struct_size > kParamInfoSize0_6) out->on_device = !sg::HostAddressable(p.value.device());
    return nullptr;
  });
}

namespace {
// The tensor sg_model_read_param / sg_model_write_param copy, checked.
sg_status* ParamTensor(const char* fn, const sg_model* model, int64_t index, int which, size_t bytes,
                       const sg::Tensor** out) {
  if (!model) return NullArg(fn, "model");
  const std::vector<sg::Param>& params = model->core->model->params();
  if (index < 0 || index >= static_cast<int64_t>(params.size()))
    return MakeStatus(SG_ERR_OUT_OF_RANGE, absl::StrCat(fn, ": argument 'index' is ", index, "; the model has ",
                                                        params.size(), " parameters"));
  if (which != SG_PARAM_VALUE && which != SG_PARAM_GRAD)
    return Invalid(absl::StrCat(fn, ": argument 'which' is ", which, "; use SG_PARAM_VALUE (0) or SG_PARAM_GRAD (1)"));
  const sg::Param& p = params[index];
  const sg::Tensor& t = which == SG_PARAM_VALUE ? p.value : p.grad;
  if (!t.defined())
    return MakeStatus(SG_ERR_FAILED_PRECONDITION, absl::StrCat(fn, ": '", p.name, "' is frozen: it has no gradient"));
  if (bytes != t.nbytes())
    return Invalid(absl::StrCat(fn, ": argument 'bytes' is ", bytes, "; '", p.name, "' has ", t.nbytes(), " bytes"));
  *out = &t;
  return nullptr;
}
}  // namespace

sg_status* sg_model_read_param(const sg_model* model, int64_t index, int which, void* dst, size_t bytes) {
  static const char fn[] = "sg_model_read_param";
  return Guard(fn, [&]() -> sg_status* {
    const sg::Tensor* t = nullptr;
    if (sg_status* s = ParamTensor(fn, model, index, which, bytes, &t)) return s;
    if (!dst) return NullArg(fn, "dst");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    sg::CopyToHost(*t, dst);
    return nullptr;
  });
}

sg_status* sg_model_write_param(sg_model* model, int64_t index, int which, const void* src, size_t bytes) {
  static const char fn[] = "sg_model_write_param";
  return Guard(fn, [&]() -> sg_status* {
    const sg::Tensor* t = nullptr;
    if (sg_status* s = ParamTensor(fn, model, index, which, bytes, &t)) return s;
    if (!src) return NullArg(fn, "src");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    sg::CopyFromHost(*t, src);
    return nullptr;
  });
}

sg_trainer_options sg_trainer_default_options(void) {
  sg_trainer_options o{};
  o.struct_size = sizeof(sg_trainer_options);
  o.strategy = "full";
  const sg::StrategyOptions so;
  const sg::OptimizerOptions oo;
  o.chunk = so.chunk;
  o.page_size = so.page_size;
  o.lm_chunk = so.lm_chunk;
  o.spaco_budget = so.spaco_budget;
  o.spaco_cap = so.spaco_cap;
  o.seed = so.seed;
  o.adjoint_form = "pairs";
  o.adjoint_window = so.adjoint_window;
  static_assert(sg::StrategyOptions::kNoAdjointWindow == INT64_MAX, "the C API documents INT64_MAX as no window");
  const sg::ObjectiveOptions obj;
  o.objective = "sft";
  o.dpo_beta = obj.dpo_beta;
  o.grpo_clip_eps = obj.grpo_clip_eps;
  o.grpo_kl_beta = obj.grpo_kl_beta;
  o.grpo_kl_bias_correction = obj.grpo_kl_bias_correction ? 1 : 0;
  o.lr = oo.lr;
  o.beta1 = oo.beta1;
  o.beta2 = oo.beta2;
  o.eps = oo.eps;
  o.weight_decay = oo.weight_decay;
  o.clip_grad_norm = oo.clip_grad_norm;
  o.lr_schedule = "constant";
  o.warmup_steps = oo.warmup_steps;
  o.min_lr = oo.min_lr;
  o.total_steps = oo.total_steps;
  o.grad_accum = oo.grad_accum;
  o.sparse_pages = so.sparse_pages;
  o.offload = so.offload ? 1 : 0;
  return o;
}

// sg_trainer_create's body; *joined tells whether it reached the tensor-parallel job.
static sg_status* CreateTrainer(const char* fn, sg_model* model, const sg_trainer_options* options,
                                sg_trainer** out, bool* joined) {
  if (!out) return NullArg(fn, "out");
  *out = nullptr;
  if (!model) return NullArg(fn, "model");
  if (!options) return NullArg(fn, "options");
  if (sg_status* s = CheckStructSize(fn, "options", options->struct_size, sizeof(sg_trainer_options),
                                     {{"0.1", kTrainerOptionsSize0_1}, {"0.2", kTrainerOptionsSize0_2},
                                      {"0.3", kTrainerOptionsSize0_3}, {"0.4", kTrainerOptionsSize0_4},
                                      {"0.5", kTrainerOptionsSize0_5}, {"0.6", kTrainerOptionsSize0_6},
                                      {"0.7 (before grpo_kl_bias_correction)", kTrainerOptionsSize0_7}}))
    return s;
  for (uint64_t r : options->reserved)
    if (r != 0) return Invalid(absl::StrCat(fn, ": options->reserved must be zero"));
  sg::StrategyOptions so;
  so.name = options->strategy ? options->strategy : "full";
  so.chunk = options->chunk;
  so.page_size = options->page_size;
  so.lm_chunk = options->lm_chunk;
  if (options->struct_size > kTrainerOptionsSize0_1) {  // a 0.1 caller's options keep the spaco defaults
    so.spaco_budget = options->spaco_budget;
    so.spaco_cap = options->spaco_cap;
    so.seed = options->seed;
  }
  if (options->struct_size > kTrainerOptionsSize0_3) {  // older callers' options keep the adjoint defaults
    so.adjoint_form = options->adjoint_form ? options->adjoint_form : "pairs";
    so.adjoint_window = options->adjoint_window;
  }
  int num_threads = 0;
  if (options->struct_size > kTrainerOptionsSize0_5) {  // older callers' options: dense, no offload
    so.sparse_pages = options->sparse_pages;
    so.offload = options->offload != 0;
    num_threads = options->num_threads;  // 0.6 callers' reserved_0_6 was zero: the default
  }
  if (num_threads < 0 || num_threads > SG_MAX_THREADS)
    return Invalid(absl::StrCat(fn, ": options->num_threads is ", num_threads, "; need 0 .. ", SG_MAX_THREADS,
                                " (0 = the calling thread's OpenMP default)"));
  const int64_t tp = options->struct_size > kTrainerOptionsSize0_6 && options->tp != 0 ? options->tp : 1;
  if (tp < 1 || tp > INT32_MAX)
    return Invalid(absl::StrCat(fn, ": options->tp is ", tp, "; need >= 1 (0 or 1 = no tensor parallelism)"));
  if (absl::StatusOr<sg::StrategyFn> f = sg::FindStrategy(so.name); !f.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(f.status().message())));
  // Checked whatever the strategy (the core checks them for "adjoint" only): a bad value is never silently kept.
  if (so.adjoint_form != "pairs" && so.adjoint_form != "scan" && so.adjoint_form != "paper")
    return Invalid(absl::StrCat(fn, ": options->adjoint_form is '", so.adjoint_form,
                                "'; known forms: pairs, scan, paper"));
  if (so.adjoint_window <= 0)
    return Invalid(absl::StrCat(fn, ": options->adjoint_window is ", so.adjoint_window,
                                "; need a positive number of tokens (INT64_MAX = no window)"));
  if (absl::Status s = sg::ValidateStrategyOptions(so); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  if (absl::Status s = sg::ValidateStrategyForModel(so, *model->core->model); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  sg::ObjectiveOptions obj;
  if (options->struct_size > kTrainerOptionsSize0_2) {  // older callers' options keep the sft defaults
    obj.name = options->objective ? options->objective : "sft";
    obj.dpo_beta = options->dpo_beta;
    obj.grpo_clip_eps = options->grpo_clip_eps;
    obj.grpo_kl_beta = options->grpo_kl_beta;
  }
  // Callers built before the field keep the plain k3 they were built for.
  obj.grpo_kl_bias_correction = options->struct_size > kTrainerOptionsSize0_7 && options->grpo_kl_bias_correction;
  if (obj.name != "sft" && obj.name != "dpo" && obj.name != "grpo")
    return Invalid(absl::StrCat(fn, ": options->objective is '", obj.name, "'; known objectives: sft, dpo, grpo"));
  if (!(obj.dpo_beta > 0 && std::isfinite(obj.dpo_beta)))
    return Invalid(absl::StrCat(fn, ": options->dpo_beta is ", obj.dpo_beta, "; need a finite value > 0"));
  if (!(obj.grpo_clip_eps > 0 && obj.grpo_clip_eps < 1))
    return Invalid(absl::StrCat(fn, ": options->grpo_clip_eps is ", obj.grpo_clip_eps, "; need (0, 1)"));
  if (!(obj.grpo_kl_beta >= 0 && std::isfinite(obj.grpo_kl_beta)))
    return Invalid(absl::StrCat(fn, ": options->grpo_kl_beta is ", obj.grpo_kl_beta, "; need a finite value >= 0"));
  if (absl::Status s = sg::ValidateObjectiveOptions(obj); !s.ok())
    return Invalid(absl::StrCat(fn, ": ", FieldMessage(s.message())));
  auto positive = [](double v) { return v > 0 && v < 1e300; };
  if (!positive(options->lr)) return Invalid(absl::StrCat(fn, ": options->lr is ", options->lr, "; need > 0"));
  if (!(options->beta1 >= 0 && options->beta1 < 1))
    return Invalid(absl::StrCat(fn, ": options->beta1 is ", options->beta1, "; need [0, 1)"));
  if (!(options->beta2 >= 0 && options->beta2 < 1))
    return Invalid(absl::StrCat(fn, ": options->beta2 is ", options->beta2, "; need [0, 1)"));
  if (!positive(options->eps)) return Invalid(absl::StrCat(fn, ": options->eps is ", options->eps, "; need > 0"));
  if (!(options->weight_decay >= 0))
    return Invalid(absl::StrCat(fn, ": options->weight_decay is ", options->weight_decay, "; need >= 0"));
  if (!(options->clip_grad_norm >= 0))
    return Invalid(absl::StrCat(fn, ": options->clip_grad_norm is ", options->clip_grad_norm, "; need >= 0"));
  sg::OptimizerOptions oo;
  oo.lr = options->lr;
  oo.beta1 = options->beta1;
  oo.beta2 = options->beta2;
  oo.eps = options->eps;
  oo.weight_decay = options->weight_decay;
  oo.clip_grad_norm = options->clip_grad_norm;
  if (options->struct_size > kTrainerOptionsSize0_4) {  // older callers' options keep a constant lr, no accumulation
    oo.lr_schedule = options->lr_schedule ? options->lr_schedule : "constant";
    oo.warmup_steps = options->warmup_steps;
    oo.min_lr = options->min_lr;
    oo.total_steps = options->total_steps;
    oo.grad_accum = options->grad_accum;
  }
  if (absl::Status s = sg::ValidateOptimizerOptions(oo); !s.ok())
    return Invalid(absl::StrCat(fn, ": options->", s.message()));
  auto t = std::make_unique<sg_trainer>();
  t->core = model->core;
  t->objective = obj;
  std::lock_guard<std::mutex> lock(t->core->mu);  // LoRA is not enabled while a trainer is being created
  if (tp > 1) {  // collective over the MPI job: every rank gets here, also with a local error
    absl::Status local;
    if (t->core->tp_group)
      local = absl::FailedPreconditionError("--tp: the model already has a tensor-parallel trainer (one per model)");
    *joined = true;
    absl::StatusOr<std::unique_ptr<sg::cabi::TensorParallelRun>> run =
        sg::cabi::JoinTensorParallel(*t->core->model, static_cast<int>(tp), local);
    if (!run.ok()) return FromAbslIn(fn, run.status());
    t->tp = std::move(*run);
  }
  sg::Model& trained = t->tp ? *t->tp->split : *t->core->model;
  t->trainer = std::make_unique<sg::Trainer>(trained, so, oo, obj);
  t->trainer->set_cancel_flag(&t->cancel);
  t->trainer->set_num_threads(num_threads);
  if (t->tp) {
    if (absl::Status s = sg::cabi::CheckSameRun(*t->tp, *t->trainer); !s.ok()) {
      t->trainer.reset();  // not counted among the model's trainers
      return FromAbslIn(fn, s);
    }
    t->core->tp_group = t->tp->world.get();  // the job's rank 0 writes (every group holds the same model)
  }
  ++t->core->trainers;
  *out = t.release();
  return nullptr;
}

sg_status* sg_trainer_create(sg_model* model, const sg_trainer_options* options, sg_trainer** out) {
  static const char fn[] = "sg_trainer_create";
  return Guard(fn, [&]() -> sg_status* {
    bool joined = false;
    sg_status* s = CreateTrainer(fn, model, options, out, &joined);
    // A rank whose own options failed still joins a tensor-parallel job, so that the others learn of it at once.
    const int64_t tp = options && options->struct_size > kTrainerOptionsSize0_6 ? options->tp : 1;
    if (s && !joined && model && tp > 1 && tp <= INT32_MAX)
      (void)sg::cabi::JoinTensorParallel(*model->core->model, static_cast<int>(tp), absl::AbortedError("failed"));
    return s;
  });
}

void sg_trainer_free(sg_trainer* trainer) { delete trainer; }

sg_metrics sg_metrics_init(void) {
  sg_metrics m{};
  m.struct_size = sizeof(sg_metrics);
  return m;
}

sg_status* sg_trainer_compute_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                        int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                        sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients";
  return Guard(fn, [&] {
    return RunStep(fn, trainer, ids, labels, num_tokens, lengths, num_sequences, out, Call::kGradients);
  });
}

sg_status* sg_trainer_step(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                           const int64_t* lengths, int64_t num_sequences, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step";
  return Guard(fn, [&] {
    return RunStep(fn, trainer, ids, labels, num_tokens, lengths, num_sequences, out, Call::kStep);
  });
}

sg_status* sg_trainer_optimizer_step(sg_trainer* trainer, sg_metrics* out) {
  static const char fn[] = "sg_trainer_optimizer_step";
  return Guard(fn, [&] { return Agreed(fn, trainer, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    if (sg_status* s = CheckMetrics(fn, out)) return s;
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (trainer->cancel.exchange(false)) return MakeStatus(SG_ERR_CANCELLED, absl::StrCat(fn, ": cancelled"));
    if (sg_status* s = Agree(fn, trainer, nullptr)) return s;
    sg::ScopedThreads threads(trainer->trainer->num_threads());
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = TakeHandleValues(trainer); !s.ok()) return FromAbslIn(fn, s);
    trainer->trainer->model().memory().ResetPeak();
    if (sg_status* s = CheckOptimizerMemory(fn, trainer)) return s;
    sg::StepMetrics m = trainer->last;
    const int64_t bytes_before = TpBytes(trainer);
    if (absl::Status s = trainer->trainer->OptimizerStep(&m); !s.ok()) return FromAbsl(s);
    if (trainer->tp) trainer->tp->bytes_last_call = TpBytes(trainer) - bytes_before;
    if (absl::Status s = ShowWholeModel(trainer, false, true); !s.ok()) return FromAbslIn(fn, s);
    Report(trainer, m, 1);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    FillMetrics(m, trainer, secs, out);
    return nullptr;
  }); });
}

int64_t sg_trainer_step_count(const sg_trainer* trainer) { return trainer ? trainer->trainer->step() : -1; }

sg_status* sg_trainer_evaluate(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                               const int64_t* lengths, int64_t num_sequences, sg_metrics* out) {
  static const char fn[] = "sg_trainer_evaluate";
  return Guard(fn, [&] {
    return RunStep(fn, trainer, ids, labels, num_tokens, lengths, num_sequences, out, Call::kEvaluate);
  });
}

sg_status* sg_trainer_set_reference(sg_trainer* trainer, sg_model* reference) {
  static const char fn[] = "sg_trainer_set_reference";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (reference) {
      if (reference->core == trainer->core)
        return Invalid(absl::StrCat(fn, ": argument 'reference' is the trainer's own model; a reference must stay "
                                        "frozen: load or create the same weights again as another model"));
      const int64_t got = reference->core->model->vocab_size(), want = trainer->core->model->vocab_size();
      if (got != want)
        return Invalid(absl::StrCat(fn, ": argument 'reference' has a vocabulary of ", got,
                                    " tokens; the trainer's model has ", want));
    }
    trainer->reference = reference ? reference->core : nullptr;
    trainer->trainer->set_reference(reference ? reference->core->model.get() : nullptr);
    return nullptr;
  });
}

sg_status* sg_trainer_set_reference_base_model(sg_trainer* trainer) {
  static const char fn[] = "sg_trainer_set_reference_base_model";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (!trainer->core->model->lora())
      return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                        absl::StrCat(fn, ": the trainer's model has no LoRA adapters (sg_model_enable_lora), so "
                                         "without them it would be the policy itself"));
    trainer->reference = nullptr;
    trainer->trainer->set_reference_base_model();
    return nullptr;
  });
}

sg_status* sg_trainer_compute_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                            const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                            const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                                            const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                            const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kGradients);
  });
}

sg_status* sg_trainer_step_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                               const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                               const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                               const int64_t* rejected_lengths, const double* ref_chosen_logp,
                               const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kStep);
  });
}

sg_status* sg_trainer_compute_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                             const int32_t* const* labels, const int64_t* lengths,
                                             const double* advantages, const double* const* old_logprobs,
                                             const double* const* ref_logprobs, int64_t num_completions,
                                             const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kGradients);
  });
}

sg_status* sg_trainer_step_grpo(sg_trainer* trainer, const int32_t* const* ids, const int32_t* const* labels,
                                const int64_t* lengths, const double* advantages, const double* const* old_logprobs,
                                const double* const* ref_logprobs, int64_t num_completions,
                                const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kStep);
  });
}

void sg_trainer_cancel(sg_trainer* trainer) {
  if (trainer) trainer->cancel.store(true, std::memory_order_relaxed);
}

sg_status* sg_trainer_set_progress_callback(sg_trainer* trainer, sg_progress_fn fn_ptr, void* user) {
  static const char fn[] = "sg_trainer_set_progress_callback";
  return Guard(fn, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    trainer->progress = fn_ptr;
    trainer->progress_user = user;
    return nullptr;
  });
}

// ---- 0.5: gradient accumulation ----

sg_status* sg_trainer_accumulate_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                           int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                           sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients";
  return Guard(fn, [&] {
    return RunStep(fn, trainer, ids, labels, num_tokens, lengths, num_sequences, out, Call::kAccumulate);
  });
}

sg_status* sg_trainer_accumulate_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                               const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                               const int32_t* const* rejected_ids,
                                               const int32_t* const* rejected_labels,
                                               const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                               const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients_dpo";
  return Guard(fn, [&] {
    return RunDpo(fn, trainer, chosen_ids, chosen_labels, chosen_lengths, rejected_ids, rejected_labels,
                  rejected_lengths, ref_chosen_logp, ref_rejected_logp, num_pairs, out, Call::kAccumulate);
  });
}

sg_status* sg_trainer_accumulate_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                                const int32_t* const* labels, const int64_t* lengths,
                                                const double* advantages, const double* const* old_logprobs,
                                                const double* const* ref_logprobs, int64_t num_completions,
                                                const int64_t* group_offsets, int64_t num_groups, sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients_grpo";
  return Guard(fn, [&] {
    return RunGrpo(fn, trainer, ids, labels, lengths, advantages, old_logprobs, ref_logprobs, num_completions,
                   group_offsets, num_groups, out, Call::kAccumulate);
  });
}

// ---- 0.5: LoRA ----

sg_lora_options sg_lora_default_options(void) {
  sg_lora_options o{};
  o.struct_size = sizeof(sg_lora_options);
  o.rank = 8;
  o.alpha = 0;  // 2 * rank
  o.dropout = 0;
  o.targets = nullptr;  // the family's default
  o.seed = 0;
  return o;
}

sg_status* sg_model_enable_lora(sg_model* model, const sg_lora_options* options) {
  static const char fn[] = "sg_model_enable_lora";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!options) return NullArg(fn, "options");
    if (sg_status* s = CheckStructSize(fn, "options", options->struct_size, sizeof(sg_lora_options))) return s;
    sg::Model& m = *model->core->model;
    if (options->rank < 1)
      return Invalid(absl::StrCat(fn, ": options->rank is ", options->rank, "; need >= 1"));
    const double alpha = options->alpha == 0 ? 2.0 * static_cast<double>(options->rank) : options->alpha;
    if (!(alpha > 0 && std::isfinite(alpha)))
      return Invalid(absl::StrCat(fn, ": options->alpha is ", options->alpha, "; need a finite value > 0 (0 = 2 * rank)"));
    if (!(options->dropout >= 0 && options->dropout < 1))
      return Invalid(absl::StrCat(fn, ": options->dropout is ", options->dropout, "; need [0, 1)"));
    const std::string targets = options->targets ? options->targets : DefaultLoraTargets(m);
    absl::StatusOr<std::vector<std::string>> parsed = sg::ParseLoraTargets(targets, m.family());
    if (!parsed.ok()) return Invalid(absl::StrCat(fn, ": ", FieldMessage(parsed.status().message())));
    sg::LoraOptions o;
    o.rank = options->rank;
    o.alpha = alpha;
    o.dropout = options->dropout;
    o.targets = *parsed;
    o.seed = options->seed;
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    std::lock_guard<std::mutex> lock(model->core->mu);
    if (sg_status* s = CheckLoraCanBeEnabled(fn, *model->core)) return s;
    if (absl::Status s = sg::EnableLora(m, o); !s.ok())
      return MakeStatus(static_cast<int>(s.code()), absl::StrCat(fn, ": ", FieldMessage(s.message())));
    model->core->lora_targets = absl::StrJoin(m.lora()->options.targets, ",");
    return nullptr;
  });
}

sg_status* sg_model_lora(const sg_model* model, sg_lora_options* out) {
  static const char fn[] = "sg_model_lora";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!out) return NullArg(fn, "out");
    if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_lora_options))) return s;
    const sg::LoraInfo* lora = model->core->model->lora();
    out->rank = lora ? lora->options.rank : 0;
    out->alpha = lora ? lora->options.alpha : 0;
    out->dropout = lora ? lora->options.dropout : 0;
    out->targets = lora ? model->core->lora_targets.c_str() : nullptr;
    out->seed = lora ? lora->options.seed : 0;
    return nullptr;
  });
}

sg_status* sg_model_save_lora_adapter(sg_model* model, const char* dir, const char* base_model_name_or_path) {
  static const char fn[] = "sg_model_save_lora_adapter";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    return FromAbslIn(
        fn, sg::SaveLoraAdapter(*model->core->model, dir, base_model_name_or_path ? base_model_name_or_path : ""));
  });
}

sg_status* sg_model_load_lora_adapter(sg_model* model, const char* dir) {
  static const char fn[] = "sg_model_load_lora_adapter";
  return Guard(fn, [&]() -> sg_status* {
    if (!model) return NullArg(fn, "model");
    if (!dir) return NullArg(fn, "dir");
    if (sg_status* s = CheckDirectory(fn, "dir", dir)) return s;
    BusyGuard guard(*model->core);
    if (!guard.acquired()) return Busy(fn);
    std::lock_guard<std::mutex> lock(model->core->mu);
    sg::Model& m = *model->core->model;
    if (!m.lora())  // enables LoRA with the adapter's options
      if (sg_status* s = CheckLoraCanBeEnabled(fn, *model->core)) return s;
    if (absl::Status s = sg::LoadLoraAdapter(m, dir); !s.ok()) return FromAbslIn(fn, s);
    model->core->lora_targets = absl::StrJoin(m.lora()->options.targets, ",");
    return nullptr;
  });
}

// ---- 0.5: checkpoints ----

sg_status* sg_trainer_save_checkpoint(sg_trainer* trainer, const char* out_dir, int64_t data_position, int64_t keep) {
  static const char fn[] = "sg_trainer_save_checkpoint";
  return Guard(fn, [&] { return Agreed(fn, trainer, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    if (!out_dir) return NullArg(fn, "out_dir");
    if (data_position < 0)
      return Invalid(absl::StrCat(fn, ": argument 'data_position' is ", data_position, "; need >= 0"));
    if (keep < 0 || keep > INT32_MAX)
      return Invalid(absl::StrCat(fn, ": argument 'keep' is ", keep, "; need >= 0 (0 = keep every checkpoint)"));
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (sg_status* s = Agree(fn, trainer, nullptr)) return s;
    std::optional<sg::dist::WholeTrainer> whole;  // tensor parallel: the checkpoint holds the whole model
    if (trainer->tp) {
      absl::StatusOr<sg::dist::WholeTrainer> w = sg::cabi::GatherWhole(*trainer->trainer);
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
    return FromAbslIn(fn, whole ? sg::cabi::WriteOnRankZero(*trainer->tp->world, save) : save());
  }); });
}

sg_status* sg_trainer_load_checkpoint(sg_trainer* trainer, const char* checkpoint_dir, int64_t* step,
                                      int64_t* data_position) {
  static const char fn[] = "sg_trainer_load_checkpoint";
  return Guard(fn, [&] { return Agreed(fn, trainer, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    if (!checkpoint_dir) return NullArg(fn, "checkpoint_dir");
    if (sg_status* s = CheckDirectory(fn, "checkpoint_dir", checkpoint_dir)) return s;
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    return LoadInto(fn, trainer, checkpoint_dir, step, data_position);
  }); });
}

sg_status* sg_trainer_resume(sg_trainer* trainer, const char* out_dir, int64_t* step, int64_t* data_position) {
  static const char fn[] = "sg_trainer_resume";
  return Guard(fn, [&] { return Agreed(fn, trainer, [&]() -> sg_status* {
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
  }); });
}

// ---- 0.7: per-token log-probs ----

sg_status* sg_trainer_score(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                            const int64_t* lengths, int64_t num_sequences, double* logprobs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_score";
  return Guard(fn, [&] {
    return RunStep(fn, trainer, ids, labels, num_tokens, lengths, num_sequences, out, Call::kScore, logprobs);
  });
}

// ---- 0.5: evaluation ----

sg_eval_result sg_eval_result_init(void) {
  sg_eval_result r{};
  r.struct_size = sizeof(sg_eval_result);
  return r;
}

sg_status* sg_trainer_evaluate_detailed(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                        int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                        const int64_t* distances, sg_eval_result* out) {
  static const char fn[] = "sg_trainer_evaluate_detailed";
  return Guard(fn, [&] { return Agreed(fn, trainer, [&]() -> sg_status* {
    if (!trainer) return NullArg(fn, "trainer");
    if (!out) return NullArg(fn, "out");
    if (sg_status* s = CheckStructSize(fn, "out", out->struct_size, sizeof(sg_eval_result))) return s;
    sg::EvalSet set;
    if (sg_status* s = BuildBatch(fn, trainer->core->model->vocab_size(), ids, labels, num_tokens, lengths,
                                  num_sequences, &set.sequences))
      return s;
    if (distances) {  // aligned with the C API's labels: the engine's position i predicts label i + 1
      int64_t off = 0;
      for (sg::Sequence& q : set.sequences) {
        std::vector<int64_t>* d = q.ids.empty() ? nullptr : &set.distances.emplace_back();
        for (size_t i = 0; i < q.labels.size(); ++i, ++off) {
          if (q.labels[i] < 0) continue;
          if (distances[off + 1] < 1)
            return Invalid(absl::StrCat(fn, ": distances[", off + 1, "] is ", distances[off + 1],
                                        " where the label is ", q.labels[i], "; need a distance >= 1"));
          d->push_back(distances[off + 1]);
        }
        ++off;  // the sequence's last token: a label only
      }
    }
    set.sequences = WithPositions(std::move(set.sequences));
    BusyGuard guard(*trainer->core);
    if (!guard.acquired()) return Busy(fn);
    if (trainer->cancel.exchange(false)) return MakeStatus(SG_ERR_CANCELLED, absl::StrCat(fn, ": cancelled"));
    if (sg_status* s = Agree(fn, trainer, nullptr)) return s;
    sg::Model& model = trainer->trainer->model();
    sg::ScopedThreads threads(trainer->trainer->num_threads());
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = TakeHandleValues(trainer); !s.ok()) return FromAbslIn(fn, s);
    model.memory().ResetPeak();
    absl::StatusOr<sg::EvalResult> r = sg::Evaluate(model, set, trainer->trainer->strategy());
    if (!r.ok()) {
      if (r.status().code() == absl::StatusCode::kCancelled) trainer->cancel.store(false);
      return FromAbslIn(fn, r.status());
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out->sequences = r->sequences;
    out->tokens = r->tokens;
    out->loss = r->loss();
    out->perplexity = r->perplexity();
    out->correct = r->correct;
    out->accuracy = r->accuracy();
    out->peak_bytes = model.memory().Snapshot().total_peak;
    out->seconds = secs;
    const int64_t buckets = std::min<int64_t>(static_cast<int64_t>(r->by_distance.size()), SG_MAX_DISTANCE_BUCKETS);
    out->num_buckets = buckets;
    for (int64_t k = 0; k < SG_MAX_DISTANCE_BUCKETS; ++k) {
      const bool in = k < buckets;
      out->bucket_count[k] = in ? r->by_distance[k].count : 0;
      out->bucket_correct[k] = in ? r->by_distance[k].correct : 0;
      out->bucket_loss[k] = in ? r->by_distance[k].loss() : 0;
    }
    return nullptr;
  }); });
}

}  // extern "C"

