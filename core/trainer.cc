#include "core/trainer.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "core/data.h"
#include "core/lora.h"
#include "core/lr_schedule.h"
#include "core/plan.h"
#include "core/tensor_parallel.h"
#include "kernels/backend.h"

namespace sg {

ScopedThreads::ScopedThreads(int threads) {
  if (threads <= 0) return;
  previous_ = omp_get_max_threads();
  SetThreads(threads);
}

ScopedThreads::~ScopedThreads() {
  if (previous_ > 0) SetThreads(previous_);
}

void SetThreads(int threads) {
  if (threads <= 0) return;
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

int Trainer::threads() const { return num_threads_ > 0 ? num_threads_ : omp_get_max_threads(); }

Trainer::Trainer(Model& model, StrategyOptions strategy, OptimizerOptions optimizer, ObjectiveOptions objective,
                 Model* reference)
    : model_(model), strategy_options_(std::move(strategy)), opt_(optimizer), objective_(std::move(objective)),
      reference_(reference) {
  if (absl::StatusOr<StrategyFn> fn = FindStrategy(strategy_options_.name); fn.ok()) strategy_ = *fn;
  // The experts go home before any step, so that no step's peak holds them; a model that cannot offload them is
  // refused by every call's validation (ValidateStrategyForModel) before its work.
  if (strategy_options_.offload_experts && model_.CheckExpertOffload().ok())
    if (absl::Status s = model_.OffloadExperts(); !s.ok()) throw std::runtime_error(std::string(s.message()));
}

absl::StatusOr<int64_t> Trainer::ValidateBatch(const std::vector<Sequence>& batch, bool for_gradients) const {
  if (absl::Status s = ValidateStrategyOptions(strategy_options_); !s.ok()) return s;
  if (absl::Status s = ValidateStrategyForModel(strategy_options_, model_); !s.ok()) return s;
  if (batch.empty()) return absl::InvalidArgumentError("batch is empty");
  int64_t valid = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const std::string what = absl::StrCat("batch sequence ", i);
    if (absl::Status s = ValidateSequence(batch[i], model_.vocab_size(), what); !s.ok()) return s;
    if (for_gradients)
      if (absl::Status s = ValidateSpacoBudget(strategy_options_, static_cast<int64_t>(batch[i].ids.size()), what);
          !s.ok())
        return s;
    for (int32_t l : batch[i].labels) valid += l >= 0;
  }
  if (valid == 0) return absl::InvalidArgumentError("batch has no valid labels (all are -100): the loss is undefined");
  return valid;
}

absl::StatusOr<StepMetrics> Trainer::EvaluateLoss(const std::vector<Sequence>& batch) {
  absl::StatusOr<int64_t> valid = ValidateBatch(batch, /*for_gradients=*/false);
  if (!valid.ok()) return valid.status();
  StepMetrics m;
  if (absl::Status s = CatchStrategyErrors("evaluation", [&] {
        for (const Sequence& seq : batch) {
          const GradResult r = sg::EvaluateLoss(model_, seq, strategy_options_);
          m.loss += r.loss_sum;
          m.tokens += r.tokens;
          m.chunks += r.chunks;
        }
      });
      !s.ok())
    return s;
  m.loss /= static_cast<double>(*valid);
  return m;
}

absl::StatusOr<StepMetrics> Trainer::ComputeGradients(const std::vector<Sequence>& batch) {
  if (absl::Status s = CheckTrainable(); !s.ok()) return s;
  pending_micro_batches_ = 0;  // gradients start afresh: a pending accumulation is dropped
  Pass pass{calls_++, 0, true};
  return WholeGradients(SftGradients(batch, 0, &pass, nullptr));
}

absl::StatusOr<StepMetrics> Trainer::WholeGradients(absl::StatusOr<StepMetrics> m) {
  if (!m.ok()) return m;
  partial_grads_ = false;
  if (absl::Status s = ReducePartialGrads(model_); !s.ok()) return s;
  return m;
}

absl::StatusOr<StepMetrics> Trainer::ComputeGradients(const Batch& batch) {
  if (absl::Status s = ValidateObjectiveOptions(objective_); !s.ok()) return s;
  pending_micro_batches_ = 0;
  Pass pass{calls_++, 0, true};
  return WholeGradients(Gradients(batch, 0, &pass, nullptr));
}

absl::StatusOr<StepMetrics> Trainer::ComputeShardGradients(const Batch& shard, double norm, uint64_t first_index) {
  if (absl::Status s = ValidateObjectiveOptions(objective_); !s.ok()) return s;
  if (absl::Status s = OneBatchForBatchLoss("data parallelism"); !s.ok()) return s;
  if (!(norm > 0) || !std::isfinite(norm))
    return absl::InvalidArgumentError(absl::StrCat("the normaliser of a shard's gradients must be positive, got ", norm));
  pending_micro_batches_ = 0;
  Pass pass{calls_++, first_index, true};
  return WholeGradients(Gradients(shard, norm, &pass, nullptr));
}

absl::Status Trainer::CheckTrainable() const {
  for (const Param& p : model_.params())
    if (p.grad.defined()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "the model was created with frozen_base and has no LoRA adapters: none of its parameters has a gradient "
      "(enable LoRA first, or create the model without frozen_base)");
}

absl::StatusOr<StepMetrics> Trainer::Gradients(const Batch& batch, double norm, Pass* pass, int64_t* count) {
  if (absl::Status s = CheckTrainable(); !s.ok()) return s;
  if (objective_.name != "sft" && model_.HasBatchLoss())
    return absl::UnimplementedError(absl::StrCat(
        objective_.name, " with the router's load-balancing loss (output_router_logits) is not supported yet: set it "
                         "false in config.json, or train sft"));
  if (objective_.name == "dpo") {
    if (count) *count = static_cast<int64_t>(batch.pairs.size());
    return DpoGradients(batch.pairs, norm, pass);
  }
  if (objective_.name == "grpo") {
    if (count) *count = static_cast<int64_t>(batch.groups.size());
    return GrpoGradients(batch.groups, norm, pass);
  }
  return SftGradients(batch.sequences, norm, pass, count);
}

absl::StatusOr<StepMetrics> Trainer::SftGradients(const std::vector<Sequence>& batch, double norm, Pass* pass,
                                                  int64_t* count) {
  absl::StatusOr<int64_t> valid = ValidateBatch(batch);
  if (!valid.ok()) return valid.status();
  if (count) *count = *valid;
  if (norm <= 0) norm = static_cast<double>(*valid);
  if (!model_.HasBatchLoss()) {
    absl::StatusOr<StepMetrics> m = Backprop(batch, 1.0 / norm, pass);
    if (!m.ok()) return m;
    m->loss /= norm;
    return CheckedLoss(std::move(m));
  }
  // A loss over the whole batch (a mixture of experts' load balancing): every input token's routing first, the
  // sequences' last tokens included, then the gradients with them (their labels ignored).
  absl::StatusOr<std::vector<Sequence>> whole = WithLastTokens(batch);
  if (!whole.ok()) return whole.status();
  absl::StatusOr<double> batch_loss = BatchStatistics(*whole);
  if (!batch_loss.ok()) return batch_loss.status();
  absl::StatusOr<StepMetrics> m = Backprop(*whole, 1.0 / norm, pass);
  model_.EndBatchLoss();
  if (!m.ok()) return m;
  m->loss = m->loss / norm + *batch_loss;
  return CheckedLoss(std::move(m));
}

absl::Status Trainer::OneBatchForBatchLoss(const char* what) const {
  if (!model_.HasBatchLoss()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "the router's load-balancing loss (output_router_logits) is over one batch's tokens; ", what,
      " would need the batches' routing statistics together, which is not supported yet (set it false in "
      "config.json, or train on one batch a step)"));
}

absl::StatusOr<std::vector<Sequence>> Trainer::WithLastTokens(const std::vector<Sequence>& batch) const {
  std::vector<Sequence> whole = batch;
  for (size_t i = 0; i < whole.size(); ++i) {
    Sequence& s = whole[i];
    if (s.last_token < 0 || s.last_token >= model_.vocab_size())
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", i, ": the router's load-balancing loss (output_router_logits) reads every input token, and ",
          s.last_token < 0 ? "this sequence's last token is unknown (a synthetic task's)"
                           : absl::StrCat("its last token ", s.last_token, " is outside the vocabulary")));
    s.ids.push_back(s.last_token);
    s.labels.push_back(-100);
    s.last_token = -1;
  }
  return whole;
}

absl::StatusOr<double> Trainer::BatchStatistics(const std::vector<Sequence>& whole) {
  model_.StartBatchStatistics();
  if (absl::Status s = CatchStrategyErrors("the batch's statistics pass",
                                           [&] {
                                             for (const Sequence& q : whole) sg::EvaluateLoss(model_, q, strategy_options_);
                                           });
      !s.ok()) {
    model_.EndBatchLoss();
    return s;
  }
  return model_.FinishBatchStatistics();
}

absl::StatusOr<StepMetrics> Trainer::CheckedLoss(absl::StatusOr<StepMetrics> m) {
  if (!std::isfinite(m->loss))
    return absl::InternalError(
        absl::StrCat("loss is ", m->loss, " at step ", step() + 1, NonFiniteWeightsNote(model_)));
  return m;
}

absl::StatusOr<int64_t> Trainer::CountUnits(const Batch& batch) const {
  if (objective_.name == "dpo") {
    if (batch.pairs.empty()) return absl::InvalidArgumentError("dpo: the batch has no pairs");
    return static_cast<int64_t>(batch.pairs.size());
  }
  if (objective_.name == "grpo") {
    if (batch.groups.empty()) return absl::InvalidArgumentError("grpo: the batch has no groups");
    return static_cast<int64_t>(batch.groups.size());
  }
  return ValidateBatch(batch.sequences);
}

absl::StatusOr<StepMetrics> Trainer::AccumulateGradients(const Batch& micro_batch) {
  if (absl::Status s = ValidateObjectiveOptions(objective_); !s.ok()) return s;
  if (absl::Status s = OneBatchForBatchLoss("gradient accumulation over micro-batches"); !s.ok()) return s;
  Pass pass{calls_++, 0, pending_micro_batches_ == 0};
  int64_t count = 0;
  absl::StatusOr<StepMetrics> m = Gradients(micro_batch, 1.0, &pass, &count);
  if (!m.ok()) {
    pending_micro_batches_ = 0;  // the gradients are partial: the next accumulation starts afresh
    return m;
  }
  if (pending_micro_batches_ == 0) {
    pending_ = StepMetrics{};
    pending_units_ = 0;
  }
  ++pending_micro_batches_;
  partial_grads_ = true;
  pending_units_ += count;
  pending_.loss += m->loss;
  pending_.tokens += m->tokens;
  pending_.chunks += m->chunks;
  pending_.chunks_backpropagated += m->chunks_backpropagated;
  pending_.adjoint_pairs += m->adjoint_pairs;
  pending_.offloaded_bytes = std::max(pending_.offloaded_bytes, m->offloaded_bytes);
  m->loss /= static_cast<double>(count);
  return m;
}

absl::StatusOr<StepMetrics> Trainer::Step(const std::vector<Batch>& micro_batches) {
  if (absl::Status s = ValidateObjectiveOptions(objective_); !s.ok()) return s;
  if (micro_batches.empty()) return absl::InvalidArgumentError("no micro-batches for the step");
  if (micro_batches.size() > 1)
    if (absl::Status s = OneBatchForBatchLoss("gradient accumulation over micro-batches"); !s.ok()) return s;
  // Validate every micro-batch and count the units of all of them before any gradient.
  int64_t total = 0;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    absl::StatusOr<int64_t> n = CountUnits(micro_batches[i]);
    if (!n.ok())
      return absl::Status(n.status().code(), absl::StrCat("micro-batch ", i, ": ", n.status().message()));
    total += *n;
  }
  pending_micro_batches_ = 0;
  Pass pass{calls_++, 0, true};
  StepMetrics sum;
  sum.micro_batches = static_cast<int64_t>(micro_batches.size());
  for (const Batch& b : micro_batches) {
    absl::StatusOr<StepMetrics> m = Gradients(b, static_cast<double>(total), &pass, nullptr);
    if (!m.ok()) return m.status();
    sum.loss = m->loss;  // a running value over the micro-batches so far (Pass::loss), in one batch's order
    sum.tokens += m->tokens;
    sum.chunks += m->chunks;
    sum.chunks_backpropagated += m->chunks_backpropagated;
    sum.adjoint_pairs += m->adjoint_pairs;
    sum.offloaded_bytes = std::max(sum.offloaded_bytes, m->offloaded_bytes);
  }
  partial_grads_ = true;
  if (absl::Status s = OptimizerStep(&sum); !s.ok()) return s;
  return sum;
}

absl::StatusOr<StepMetrics> Trainer::Backprop(const std::vector<Sequence>& seqs, double grad_scale, Pass* pass) {
  StepMetrics m;
  m.loss = pass->loss_sum;
  if (pass->zero) ZeroGrads(model_);
  pass->zero = false;
  const uint64_t call = pass->call;
  if (absl::Status s = CatchStrategyErrors(
          absl::StrCat("step ", step() + 1, " (strategy '", strategy_options_.name, "')"),
          [&] {
            std::vector<LossSum> losses;  // read once the device work is done: no chunk waits for its loss
            for (size_t i = 0; i < seqs.size(); ++i) {
              StrategyOptions o = strategy_options_;
              o.seed = SequenceSeed(strategy_options_.seed, call, pass->next_index++);
              GradResult r = strategy_(model_, seqs[i], grad_scale, o);
              losses.push_back(std::move(r.loss_sum));
              m.tokens += r.tokens;
              m.chunks += r.chunks;
              m.chunks_backpropagated += r.chunks_backpropagated;
              m.adjoint_pairs += r.adjoint_pairs;
              m.offloaded_bytes = std::max(m.offloaded_bytes, r.offloaded_bytes);
            }
            if (strategy_options_.offload_experts) m.offloaded_bytes += model_.OffloadedWeightBytes();
            SynchronizeDevice(model_.memory().device());  // faults of the step's device work, as this step's
            for (const LossSum& loss : losses) m.loss += loss.value();
            pass->loss_sum = m.loss;
          });
      !s.ok())
    return s;
  return m;
}

absl::StatusOr<std::vector<double>> Trainer::TokenLogprobs(Model& model, const Sequence& s) {
  std::vector<double> logp(s.ids.size(), std::nan(""));
  Sequence recorded{s.ids, s.labels, RecordingObjective(&logp), s.doc_starts};
  if (absl::Status s = CatchStrategyErrors("log-prob pass", [&] { sg::EvaluateLoss(model, recorded, strategy_options_); });
      !s.ok())
    return s;
  return logp;
}

absl::StatusOr<std::vector<double>> Trainer::ReferenceLogprobs(const Sequence& s) {
  if (!reference_is_base_) return TokenLogprobs(*reference_, s);
  if (!model_.lora())
    return absl::FailedPreconditionError(
        "the reference is the model without its LoRA adapters (set_reference_base_model), but LoRA is not enabled "
        "on the model: that reference would be the policy itself");
  LoraDisabled base(model_);
  return TokenLogprobs(model_, s);
}

namespace {
double SumLabelled(const std::vector<double>& logp) {
  double sum = 0;
  for (double x : logp)
    if (!std::isnan(x)) sum += x;
  return sum;
}
double LogSigmoid(double z) { return z >= 0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }
double Sigmoid(double z) { return z >= 0 ? 1 / (1 + std::exp(-z)) : std::exp(z) / (1 + std::exp(z)); }
}  // namespace

// DPO in two passes (StreamBP eq. 8-10): the first accumulates each response's log-prob sum chunk by chunk; the
// pair's sigmoid factor then makes the loss linear in the token log-probs for the backward pass.
absl::StatusOr<StepMetrics> Trainer::DpoGradients(const std::vector<DpoPair>& pairs, double norm, Pass* pass) {
  if (pairs.empty()) return absl::InvalidArgumentError("dpo: the batch has no pairs");
  std::vector<Sequence> all;
  for (size_t i = 0; i < pairs.size(); ++i) {
    for (const Sequence* s : {&pairs[i].chosen, &pairs[i].rejected}) {
      const std::string what = absl::StrCat("pair ", i, s == &pairs[i].chosen ? " chosen" : " rejected");
      if (absl::Status st = ValidateBatch({*s}).status(); !st.ok())
        return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    }
    if ((std::isnan(pairs[i].ref_chosen_logp) || std::isnan(pairs[i].ref_rejected_logp)) && !has_reference())
      return absl::InvalidArgumentError(absl::StrCat(
          "dpo: pair ", i, " has no reference log-probs (ref_chosen_logp, ref_rejected_logp) and no reference model "
          "was given"));
  }
  const double beta = objective_.dpo_beta, P = norm > 0 ? norm : static_cast<double>(pairs.size());
  StepMetrics metrics;
  metrics.loss = pass->dpo_loss;
  for (const DpoPair& p : pairs) {
    double pi[2], ref[2] = {p.ref_chosen_logp, p.ref_rejected_logp};
    const Sequence* seq[2] = {&p.chosen, &p.rejected};
    for (int k = 0; k < 2; ++k) {
      absl::StatusOr<std::vector<double>> lp = TokenLogprobs(model_, *seq[k]);
      if (!lp.ok()) return lp.status();
      pi[k] = SumLabelled(*lp);
      if (std::isnan(ref[k])) {
        absl::StatusOr<std::vector<double>> rl = ReferenceLogprobs(*seq[k]);
        if (!rl.ok()) return rl.status();
        ref[k] = SumLabelled(*rl);
      }
    }
    const double z = beta * ((pi[0] - ref[0]) - (pi[1] - ref[1]));
    metrics.loss -= LogSigmoid(z) / P;
    pass->dpo_loss = metrics.loss;
    const double c = -beta * Sigmoid(-z) / P;  // dL/dpi_chosen; dL/dpi_rejected = -c
    all.push_back({p.chosen.ids, p.chosen.labels, LinearObjective(c), p.chosen.doc_starts});
    all.push_back({p.rejected.ids, p.rejected.labels, LinearObjective(-c), p.rejected.doc_starts});
  }
  absl::StatusOr<StepMetrics> m = Backprop(all, 1.0, pass);
  if (!m.ok()) return m;
  m->loss = metrics.loss;
  if (!std::isfinite(m->loss))
    return absl::InternalError(
        absl::StrCat("dpo loss is ", m->loss, " at step ", step() + 1, NonFiniteWeightsNote(model_)));
  return m;
}

absl::StatusOr<StepMetrics> Trainer::GrpoGradients(const std::vector<GrpoGroup>& groups, double norm,
                                                   Pass* pass) {
  if (groups.empty()) return absl::InvalidArgumentError("grpo: the batch has no groups");
  std::vector<Sequence> all;
  const double B = norm > 0 ? norm : static_cast<double>(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<GrpoCompletion>& cs = groups[g].completions;
    if (cs.empty()) return absl::InvalidArgumentError(absl::StrCat("grpo: group ", g, " has no completions (G = 0)"));
    for (size_t i = 0; i < cs.size(); ++i) {
      const GrpoCompletion& c = cs[i];
      const std::string what = absl::StrCat("grpo: group ", g, " completion ", i);
      absl::StatusOr<int64_t> tokens = ValidateBatch({c.seq});
      if (!tokens.ok()) return absl::Status(tokens.status().code(), absl::StrCat(what, ": ", tokens.status().message()));
      for (const auto* v : {&c.old_logprobs, &c.ref_logprobs})
        if (!v->empty() && v->size() != c.seq.ids.size())
          return absl::InvalidArgumentError(absl::StrCat(what, ": ", v == &c.old_logprobs ? "old" : "ref",
                                                         "_logprobs has ", v->size(), " entries for ",
                                                         c.seq.ids.size(), " positions"));
      if (!std::isfinite(c.advantage))
        return absl::InvalidArgumentError(absl::StrCat(what, ": advantage is not finite"));
      std::vector<double> ref = c.ref_logprobs;
      if (objective_.grpo_kl_beta > 0 && ref.empty()) {
        if (!has_reference())
          return absl::InvalidArgumentError(absl::StrCat(
              what, ": no ref_logprobs and no reference model, but grpo_kl_beta > 0 needs one"));
        absl::StatusOr<std::vector<double>> rl = ReferenceLogprobs(c.seq);
        if (!rl.ok()) return rl.status();
        ref = std::move(*rl);
      }
      const double scale = 1.0 / (static_cast<double>(*tokens) * static_cast<double>(cs.size()) * B);
      all.push_back({c.seq.ids, c.seq.labels, GrpoObjective(c, std::move(ref), objective_, scale), c.seq.doc_starts});
    }
  }
  absl::StatusOr<StepMetrics> m = Backprop(all, 1.0, pass);
  if (m.ok() && !std::isfinite(m->loss))
    return absl::InternalError(
        absl::StrCat("grpo loss is ", m->loss, " at step ", step() + 1, NonFiniteWeightsNote(model_)));
  return m;
}

void Trainer::set_state(const TrainerState& s) {
  adam_.set_step(s.step);
  calls_ = s.sampling_calls;
  pending_micro_batches_ = 0;
}

absl::Status Trainer::OptimizerStep(StepMetrics* metrics) {
  if (absl::Status s = ValidateOptimizerOptions(opt_); !s.ok()) return s;
  const std::string when = absl::StrCat("at step ", step() + 1);
  if (pending_micro_batches_ > 0) {  // streaming accumulation: the sum becomes the mean over all micro-batches
    const double units = static_cast<double>(pending_units_);
    if (!std::isfinite(pending_.loss))
      return absl::InternalError(absl::StrCat("loss is ", pending_.loss, " ", when, NonFiniteWeightsNote(model_)));
    ScaleGrads(model_, 1.0 / units);
    if (metrics) {
      *metrics = pending_;
      metrics->loss = pending_.loss / units;
      metrics->micro_batches = pending_micro_batches_;
    }
    pending_micro_batches_ = 0;
  }
  if (partial_grads_) {  // accumulated micro-batches: their tensor-parallel partial sums are reduced once
    partial_grads_ = false;
    if (absl::Status s = ReducePartialGrads(model_); !s.ok()) return s;
  }
  absl::StatusOr<double> sq = TensorParallelGradSquaredNorm(model_, when);
  if (!sq.ok()) return sq.status();
  const double norm = std::sqrt(*sq);
  if (metrics) metrics->grad_norm = norm;
  if (opt_.clip_grad_norm > 0 && norm > opt_.clip_grad_norm) ScaleGrads(model_, opt_.clip_grad_norm / norm);
  const double lr = ScheduledLr(opt_, step() + 1);
  if (metrics) metrics->lr = lr;
  return adam_.Step(model_, opt_, lr);
}

absl::StatusOr<StepMetrics> Trainer::Step(const Batch& batch) {
  absl::StatusOr<StepMetrics> m = ComputeGradients(batch);
  if (!m.ok()) return m.status();
  if (absl::Status s = OptimizerStep(&*m); !s.ok()) return s;
  return m;
}

absl::StatusOr<StepMetrics> Trainer::Step(const std::vector<Sequence>& batch) {
  absl::StatusOr<StepMetrics> m = ComputeGradients(batch);
  if (!m.ok()) return m.status();
  if (absl::Status s = OptimizerStep(&*m); !s.ok()) return s;
  return m;
}

}  // namespace sg

namespace sg {

absl::StatusOr<BudgetFit> FitMemoryBudget(Model& model, const StrategyOptions& strategy, const Sequence& probe,
                                          int64_t budget, int64_t reserved) {
  if (budget <= 0) return absl::InvalidArgumentError(absl::StrCat("the memory budget must be positive, got ", budget));
  const int64_t resting = model.memory().Snapshot().total_current;
  if (resting + reserved >= budget)
    return absl::ResourceExhaustedError(absl::StrCat(
        "the budget of ", budget, " bytes is below what the model holds before any step: ", resting,
        " bytes (weights, gradients) + ", reserved, " bytes of optimizer state = ", resting + reserved, " bytes"));
  BudgetFit fit;
  const std::string& name = strategy.name;
  fit.chunked = name == "seco" || name == "spaco" || name == "adjoint" || name == "streambp";
  const int64_t length = static_cast<int64_t>(probe.ids.size());
  std::vector<int64_t> candidates;
  if (!fit.chunked) {
    candidates.push_back(strategy.chunk);
  } else {
    const int64_t smallest = std::min<int64_t>(16, length);
    for (int64_t c = length; c >= smallest;) {
      const int64_t chunks = (length + c - 1) / c;
      if (name != "spaco" || chunks >= strategy.spaco_budget) candidates.push_back(c);
      int64_t next = 1;
      while (next * 2 < c) next *= 2;  // the largest power of two below c
      if (next >= c || c == smallest) break;
      c = std::max(next, smallest);
    }
    if (candidates.empty())
      return absl::InvalidArgumentError(absl::StrCat("--spaco_budget=", strategy.spaco_budget,
                                                     " needs at least that many chunks, but the longest sequence has ",
                                                     length, " tokens"));
  }
  // The passes are planned on a meta twin of the model (core/plan.h): the same allocations, no compute, and the
  // model itself untouched.
  absl::StatusOr<std::unique_ptr<Model>> twin = MetaTwin(model);
  if (!twin.ok()) return twin.status();
  MemoryTracker& mem = (*twin)->memory();
  // One gradient pass at `chunk` under `limit`: its peak plus reserved, or -1 when the limit stops it.
  auto run = [&](int64_t chunk, int64_t limit) -> absl::StatusOr<int64_t> {
    StrategyOptions o = strategy;
    o.chunk = chunk;
    Trainer probe_trainer(**twin, o, OptimizerOptions{});  // its own sampling stream: the run's is untouched
    mem.ResetPeak();
    mem.set_limit(limit);
    absl::StatusOr<StepMetrics> m = probe_trainer.ComputeGradients(std::vector<Sequence>{probe});
    mem.set_limit(0);
    const int64_t peak = mem.Snapshot().total_peak;
    mem.ResetPeak();
    if (!m.ok()) {
      if (m.status().code() == absl::StatusCode::kResourceExhausted) return -1;
      return m.status();
    }
    return peak + reserved;
  };
  for (int64_t chunk : candidates) {
    absl::StatusOr<int64_t> peak = run(chunk, budget - reserved);
    if (!peak.ok()) return peak.status();
    fit.probes.push_back({chunk, *peak});
    if (*peak >= 0) {
      fit.chunk = chunk;
      fit.peak_bytes = *peak;
      return fit;
    }
  }
  const int64_t smallest = candidates.back();
  absl::StatusOr<int64_t> need = run(smallest, 16 * budget - reserved);
  if (!need.ok()) return need.status();
  const std::string what =
      fit.chunked ? absl::StrCat("--strategy=", name, " with the smallest --chunk tried (", smallest, ")")
                  : absl::StrCat("--strategy=", name);
  const std::string needs = *need >= 0 ? absl::StrCat("needs ", *need, " bytes")
                                       : absl::StrCat("needs more than ", 16 * budget, " bytes (16 x the budget)");
  return absl::ResourceExhaustedError(absl::StrCat(what, " on a sequence of ", length, " tokens ", needs,
                                                   " (optimizer state included) but the budget is ", budget,
                                                   " bytes"));
}

}  // namespace sg
