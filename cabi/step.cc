// The trainer's calls on token batches (sft's gradients and steps, evaluation, per-token log-probs, the optimizer
// step), and Run, which every call that runs the model goes through.
#include <chrono>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cabi/internal.h"

namespace sg::cabi {
namespace {

void Report(sg_trainer* t, const StepMetrics& m, int phase) {
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

// sg_trainer_score's body: per sequence the engine's log-probs (position t: of label t + 1) written one entry later,
// at the label they belong to; NaN at each sequence's position 0 and where there is no label.
absl::StatusOr<StepMetrics> Score(Trainer& trainer, const std::vector<Sequence>& batch, double* logprobs) {
  StepMetrics m;
  double sum = 0;
  for (const Sequence& q : batch) {
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
sg_status* RunStepOn(const char* fn, sg_trainer* t, const sg_batch& b, sg_metrics* out, Call call,
                     double* logprobs = nullptr) {
  if (!t) return NullArg(fn, "trainer");
  if (sg_status* s = CheckMetrics(fn, out)) return s;
  const bool forward_only = call == Call::kEvaluate || call == Call::kScore;
  if (call == Call::kScore && !logprobs) return NullArg(fn, "logprobs");
  if (!forward_only && t->objective.name != "sft")
    return WrongObjective(fn, t, "sft",
                          t->objective.name == "dpo" ? "sg_trainer_step_dpo / compute_gradients_dpo"
                                                     : "sg_trainer_step_grpo / compute_gradients_grpo");
  std::vector<Sequence> batch;
  if (sg_status* s = BuildBatch(fn, t->core->model->vocab_size(), b, &batch, call == Call::kScore)) return s;
  Trainer& trainer = *t->trainer;
  return Run(fn, t, forward_only ? Call::kEvaluate : call, false, out, nullptr, [&]() -> absl::StatusOr<StepMetrics> {
    if (call == Call::kScore) return Score(trainer, batch, logprobs);
    if (call == Call::kEvaluate) return trainer.EvaluateLoss(WithPositions(std::move(batch)));
    Batch whole;
    whole.sequences = WithPositions(std::move(batch));
    return dist::ComputeGradients(trainer, t->tp.get(), whole, call == Call::kAccumulate);
  });
}

// Every call on a batch: the batch checked, then RunStepOn, agreeing across tensor-parallel ranks.
sg_status* RunBatch(const char* fn, sg_trainer* t, const sg_batch* b, sg_metrics* out, Call call,
                    double* logprobs = nullptr) {
  return Guard(fn, [&] {
    return Agreed(fn, t, [&] {
      if (sg_status* s = CheckBatch(fn, b)) return s;
      return RunStepOn(fn, t, *b, out, call, logprobs);
    });
  });
}

}  // namespace

sg_status* WrongObjective(const char* fn, const sg_trainer* t, const char* needs, const char* use) {
  return MakeStatus(SG_ERR_FAILED_PRECONDITION,
                    absl::StrCat(fn, ": the trainer's objective is '", t->objective.name, "'; this call needs '", needs,
                                 "' (options->objective)", use[0] ? absl::StrCat("; use ", use) : ""));
}

sg_status* Run(const char* fn, sg_trainer* t, Call call, bool with_reference, sg_metrics* out,
               const std::function<sg_status*()>& check, const std::function<absl::StatusOr<StepMetrics>()>& compute) {
  ModelCore& core = *t->core;
  BusyGuard guard(core);
  if (!guard.acquired()) return Agree(fn, t, Busy(fn));
  std::unique_ptr<BusyGuard> reference_guard;
  if (with_reference && t->reference) {
    reference_guard = std::make_unique<BusyGuard>(*t->reference);
    if (!reference_guard->acquired())
      return Agree(
          fn, t,
          MakeStatus(SG_ERR_BUSY, absl::StrCat(fn, ": the trainer's reference model is in use by another call")));
  }
  if (check)
    if (sg_status* s = check()) return Agree(fn, t, s);
  if (t->cancel.exchange(false)) return Agree(fn, t, Cancelled(fn));
  if (sg_status* s = Agree(fn, t, nullptr)) return s;
  ScopedThreads threads(t->trainer->num_threads());
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = TakeHandleValues(t); !s.ok()) return FromAbslIn(fn, s);
  t->trainer->model().memory().ResetPeak();
  const int64_t bytes_before = TpBytes(t);
  absl::StatusOr<StepMetrics> m = compute();
  if (!m.ok()) {
    if (m.status().code() == absl::StatusCode::kCancelled) t->cancel.store(false);
    return FromAbsl(m.status());
  }
  if (call != Call::kEvaluate) {
    t->last = *m;
    Report(t, *m, 0);
  }
  if (call == Call::kStep) {
    if (t->cancel.exchange(false)) return Cancelled(fn);
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

}  // namespace sg::cabi

using namespace sg::cabi;  // NOLINT: the entry points call its helpers

extern "C" {

sg_status* sg_trainer_compute_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                        int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                        sg_metrics* out) {
  static const char fn[] = "sg_trainer_compute_gradients";
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return RunBatch(fn, trainer, &b, out, Call::kGradients);
}

sg_status* sg_trainer_step(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                           const int64_t* lengths, int64_t num_sequences, sg_metrics* out) {
  static const char fn[] = "sg_trainer_step";
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return RunBatch(fn, trainer, &b, out, Call::kStep);
}

sg_status* sg_trainer_accumulate_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                           int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                           sg_metrics* out) {
  static const char fn[] = "sg_trainer_accumulate_gradients";
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return RunBatch(fn, trainer, &b, out, Call::kAccumulate);
}

sg_status* sg_trainer_optimizer_step(sg_trainer* trainer, sg_metrics* out) {
  static const char fn[] = "sg_trainer_optimizer_step";
  return Guard(fn, [&] {
    return Agreed(fn, trainer, [&]() -> sg_status* {
      if (!trainer) return NullArg(fn, "trainer");
      if (sg_status* s = CheckMetrics(fn, out)) return s;
      BusyGuard guard(*trainer->core);
      if (!guard.acquired()) return Busy(fn);
      if (trainer->cancel.exchange(false)) return Cancelled(fn);
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
    });
  });
}

sg_status* sg_trainer_evaluate(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                               const int64_t* lengths, int64_t num_sequences, sg_metrics* out) {
  static const char fn[] = "sg_trainer_evaluate";
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return RunBatch(fn, trainer, &b, out, Call::kEvaluate);
}

sg_status* sg_trainer_score(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                            const int64_t* lengths, int64_t num_sequences, double* logprobs, sg_metrics* out) {
  static const char fn[] = "sg_trainer_score";
  const sg_batch b = FlatBatch(ids, labels, num_tokens, lengths, num_sequences);
  return RunBatch(fn, trainer, &b, out, Call::kScore, logprobs);
}

sg_status* sg_trainer_compute_gradients_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out) {
  return RunBatch("sg_trainer_compute_gradients_batch", trainer, batch, out, Call::kGradients);
}

sg_status* sg_trainer_step_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out) {
  return RunBatch("sg_trainer_step_batch", trainer, batch, out, Call::kStep);
}

sg_status* sg_trainer_accumulate_gradients_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out) {
  return RunBatch("sg_trainer_accumulate_gradients_batch", trainer, batch, out, Call::kAccumulate);
}

sg_status* sg_trainer_evaluate_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out) {
  return RunBatch("sg_trainer_evaluate_batch", trainer, batch, out, Call::kEvaluate);
}

sg_status* sg_trainer_score_batch(sg_trainer* trainer, const sg_batch* batch, double* logprobs, sg_metrics* out) {
  return RunBatch("sg_trainer_score_batch", trainer, batch, out, Call::kScore, logprobs);
}

}  // extern "C"
