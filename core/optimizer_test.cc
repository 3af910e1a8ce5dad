// The optimizer: learning-rate schedules, gradient accumulation against one big batch (fp64), NaN/Inf guards.
#include "core/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/gradcheck.h"
#include "core/lr_schedule.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::unique_ptr<TransformerModel> Tiny(const std::string& preset = "tiny") {
  auto model = CreateTransformer(*TransformerPreset(preset), DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 11;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

TEST(LrScheduleTest, WarmupThenDecay) {
  OptimizerOptions o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 4;
  o.total_steps = 14;
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 1), 0.25);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 4), 1.0);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 9), 1.0);  // constant
  o.lr_schedule = "cosine";
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 2), 0.5);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 4), 1.0);
  EXPECT_NEAR(ScheduledLr(o, 9), 0.55, 1e-15);  // half way: (lr + min_lr) / 2
  EXPECT_NEAR(ScheduledLr(o, 14), 0.1, 1e-15);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 100), 0.1);
  o.lr_schedule = "linear";
  EXPECT_NEAR(ScheduledLr(o, 6), 1.0 - 0.9 * 0.2, 1e-15);
  EXPECT_NEAR(ScheduledLr(o, 14), 0.1, 1e-15);
  o.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 1), 1.0 - 0.9 / 14);
  EXPECT_TRUE(ValidateOptimizerOptions(o).ok());
}

TEST(LrScheduleTest, BadOptions) {
  auto error = [](OptimizerOptions o) { return std::string(ValidateOptimizerOptions(o).message()); };
  OptimizerOptions o;
  o.lr_schedule = "step";
  EXPECT_NE(error(o).find("lr_schedule 'step' is not known; known schedules: constant, cosine, linear"),
            std::string::npos)
      << error(o);
  o.lr_schedule = "cosine";
  o.warmup_steps = 10;
  o.total_steps = 10;
  EXPECT_NE(error(o).find("total_steps must be larger"), std::string::npos) << error(o);
  o.total_steps = 20;
  o.min_lr = 1;
  EXPECT_NE(error(o).find("min_lr is 1; need 0 <= min_lr <= lr"), std::string::npos) << error(o);
  o.min_lr = 0;
  o.grad_accum = 0;
  EXPECT_NE(error(o).find("grad_accum is 0"), std::string::npos) << error(o);
  o.grad_accum = 1;
  o.warmup_steps = -1;
  EXPECT_NE(error(o).find("warmup_steps is -1"), std::string::npos) << error(o);
  o.warmup_steps = 0;
  o.lr = -1;
  EXPECT_NE(error(o).find("lr is -1"), std::string::npos) << error(o);
}

// The learning rate each step used is the schedule's.
TEST(LrScheduleTest, TrainerFollowsSchedule) {
  auto model = Tiny();
  OptimizerOptions o;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.lr_schedule = "cosine";
  o.warmup_steps = 2;
  o.total_steps = 5;
  Trainer trainer(*model, StrategyOptions{}, o);
  const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 3);
  for (int64_t step = 1; step <= 6; ++step) {
    absl::StatusOr<StepMetrics> m = trainer.Step(batch);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_DOUBLE_EQ(m->lr, ScheduledLr(o, step)) << step;
    EXPECT_EQ(trainer.step(), step);
  }
}

std::vector<double> Flat(Model& m, bool grads) {
  std::vector<double> out;
  for (Param& p : m.params()) {
    const Tensor& t = grads ? p.grad : p.value;
    if (!t.defined()) continue;
    out.insert(out.end(), t.data<double>(), t.data<double>() + t.numel());
  }
  return out;
}

double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

Batch Concat(const Batch& a, const Batch& b) {
  Batch c = a;
  c.sequences.insert(c.sequences.end(), b.sequences.begin(), b.sequences.end());
  c.pairs.insert(c.pairs.end(), b.pairs.begin(), b.pairs.end());
  c.groups.insert(c.groups.end(), b.groups.begin(), b.groups.end());
  return c;
}

// N micro-batches accumulated into one optimizer step give the loss, gradient and update of one batch holding all
// their sequences: sft (token-mean over every micro-batch's tokens), dpo (mean over pairs), grpo (mean over
// groups); exact strategies and both accumulation APIs.
TEST(GradAccumTest, EqualsOneBigBatch) {
  for (const std::string objective : {"sft", "dpo", "grpo"}) {
    for (const std::string strategy : {"full", "seco"}) {
      ObjectiveOptions obj;
      obj.name = objective;
      StrategyOptions so;
      so.name = strategy;
      so.chunk = 5;
      so.page_size = 4;
      OptimizerOptions oo;
      oo.clip_grad_norm = 0;  // the gradient stays as computed, to compare
      oo.weight_decay = 0.1;
      auto probe = Tiny();
      absl::StatusOr<Batch> a = MakeCheckBatch(*probe, obj, 21, 1), b = MakeCheckBatch(*probe, obj, 13, 2),
                            c = MakeCheckBatch(*probe, obj, 17, 3);
      ASSERT_TRUE(a.ok() && b.ok() && c.ok());
      const Batch big = Concat(Concat(*a, *b), *c);
      const std::string what = objective + " " + strategy;

      auto reference = Tiny();
      Trainer ref(*reference, so, oo, obj);
      absl::StatusOr<StepMetrics> r = ref.Step(big);
      ASSERT_TRUE(r.ok()) << r.status();

      auto accumulated = Tiny();  // Step over micro-batches
      Trainer acc(*accumulated, so, oo, obj);
      absl::StatusOr<StepMetrics> m = acc.Step(std::vector<Batch>{*a, *b, *c});
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_EQ(m->micro_batches, 3);
      EXPECT_NEAR(m->loss, r->loss, 1e-12 * std::abs(r->loss)) << what;
      EXPECT_NEAR(m->grad_norm, r->grad_norm, 1e-12 * r->grad_norm) << what;
      EXPECT_EQ(m->tokens, r->tokens);
      EXPECT_LE(MaxRelDiff(Flat(*accumulated, true), Flat(*reference, true)), 1e-12) << what;
      EXPECT_LE(MaxRelDiff(Flat(*accumulated, false), Flat(*reference, false)), 1e-12) << what;

      auto streamed = Tiny();  // AccumulateGradients one at a time, then OptimizerStep
      Trainer st(*streamed, so, oo, obj);
      for (const Batch* micro : {&*a, &*b, &*c}) ASSERT_TRUE(st.AccumulateGradients(*micro).ok());
      StepMetrics sm;
      ASSERT_TRUE(st.OptimizerStep(&sm).ok());
      EXPECT_EQ(sm.micro_batches, 3);
      EXPECT_NEAR(sm.loss, r->loss, 1e-12 * std::abs(r->loss)) << what;
      EXPECT_NEAR(sm.grad_norm, r->grad_norm, 1e-12 * r->grad_norm) << what;
      EXPECT_LE(MaxRelDiff(Flat(*streamed, true), Flat(*reference, true)), 1e-12) << what;
      EXPECT_LE(MaxRelDiff(Flat(*streamed, false), Flat(*reference, false)), 1e-12) << what;
    }
  }
}

// A bad micro-batch is refused before any gradient is computed.
TEST(GradAccumTest, ValidatesEveryMicroBatchFirst) {
  auto model = Tiny();
  Trainer trainer(*model, StrategyOptions{}, {});
  Batch good, bad;
  good.sequences = RaggedBatch(model->vocab_size(), 1);
  bad.sequences = RaggedBatch(model->vocab_size(), 2);
  bad.sequences[1].ids[0] = 100000;
  absl::StatusOr<StepMetrics> m = trainer.Step(std::vector<Batch>{good, bad});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("micro-batch 1: "), std::string::npos) << m.status();
  EXPECT_EQ(trainer.step(), 0);
}

// f_t with a finite value but a NaN derivative: the loss is finite, the gradients are not.
class NanGradient : public TokenObjective {
 public:
  double Term(int64_t t, double logp, double* dloss) const override {
    *dloss = t == 4 ? std::nan("") : -1.0;
    return -logp;
  }
};

TEST(GuardTest, NonFiniteGradientNamesStepAndTensor) {
  auto model = Tiny();
  Trainer trainer(*model, StrategyOptions{}, {});
  std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 5);
  ASSERT_TRUE(trainer.Step(batch).ok());
  batch[0].objective = std::make_shared<NanGradient>();
  const std::vector<double> before = Flat(*model, false);
  absl::StatusOr<StepMetrics> m = trainer.Step(batch);
  ASSERT_FALSE(m.ok());
  const std::string msg(m.status().message());
  EXPECT_NE(msg.find("gradient of 'model."), std::string::npos) << msg;
  EXPECT_NE(msg.find("is not finite at step 2: element "), std::string::npos) << msg;
  EXPECT_EQ(trainer.step(), 1);
  EXPECT_EQ(Flat(*model, false), before);  // no update
}

TEST(GuardTest, NonFiniteLossNamesStepAndParameter) {
  auto model = Tiny();
  Trainer trainer(*model, StrategyOptions{}, {});
  const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 5);
  Param& p = model->params()[3];
  p.value.data<double>()[7] = INFINITY;
  absl::StatusOr<StepMetrics> m = trainer.Step(batch);
  ASSERT_FALSE(m.ok());
  const std::string msg(m.status().message());
  EXPECT_EQ(msg.find("loss is "), 0u) << msg;
  EXPECT_NE(msg.find(" at step 1; parameter '"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parameter '" + p.name + "' holds inf at element 7"), std::string::npos) << msg;
  // Accumulation reports it the same way.
  Batch micro;
  micro.sequences = batch;
  m = trainer.Step(std::vector<Batch>{micro, micro});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("at step 1"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace sg

namespace sg {
namespace {

// --memory_budget's search: the chunk it picks runs within the budget and the next larger candidate does not;
// a budget below the smallest candidate's need is refused with both numbers.
TEST(MemoryBudgetTest, PicksLargestChunkThatFitsOrRefuses) {
  auto model = Tiny();
  Sequence probe = RaggedBatch(model->vocab_size(), 4)[0];
  while (probe.ids.size() < 200) {  // 23 tokens -> 207: candidates 207, 128, 64, 32, 16
    probe.ids.insert(probe.ids.end(), probe.ids.begin(), probe.ids.begin() + 23);
    probe.labels.insert(probe.labels.end(), probe.labels.begin(), probe.labels.begin() + 23);
  }
  StrategyOptions so;
  so.name = "seco";
  so.page_size = 8;
  const int64_t reserved = AdamW::StateBytes(*model);
  absl::StatusOr<BudgetFit> unlimited = FitMemoryBudget(*model, so, probe, int64_t{1} << 40, reserved);
  ASSERT_TRUE(unlimited.ok()) << unlimited.status();
  EXPECT_EQ(unlimited->chunk, static_cast<int64_t>(probe.ids.size()));  // everything fits: one chunk
  const int64_t whole = unlimited->peak_bytes;

  absl::StatusOr<BudgetFit> fit = FitMemoryBudget(*model, so, probe, whole - 1, reserved);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_TRUE(fit->chunked);
  EXPECT_LT(fit->chunk, static_cast<int64_t>(probe.ids.size()));
  EXPECT_LE(fit->peak_bytes, whole - 1);
  ASSERT_GE(fit->probes.size(), 2u);
  EXPECT_EQ(fit->probes.front().second, -1);  // the whole sequence is over
  // The pick really runs under the limit.
  so.chunk = fit->chunk;
  model->memory().set_limit(whole - 1 - reserved);
  Trainer trainer(*model, so, {});
  EXPECT_TRUE(trainer.ComputeGradients(std::vector<Sequence>{probe}).ok());
  model->memory().set_limit(0);

  const int64_t resting = model->memory().Snapshot().total_current;
  absl::StatusOr<BudgetFit> none = FitMemoryBudget(*model, so, probe, resting + reserved + 1000, reserved);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("with the smallest --chunk tried (16) on a sequence of 207 tokens needs "),
            std::string::npos)
      << none.status();
  absl::StatusOr<BudgetFit> below = FitMemoryBudget(*model, so, probe, 1000, reserved);
  ASSERT_FALSE(below.ok());
  EXPECT_NE(below.status().message().find("is below what the model holds before any step"), std::string::npos);
  EXPECT_EQ(model->memory().limit(), 0);
}

}  // namespace
}  // namespace sg
