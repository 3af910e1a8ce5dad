// Every exact strategy against full backprop in fp64, and full backprop against finite differences of the loss.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <set>

#include "core/data.h"
#include "core/gradcheck.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::unique_ptr<TransformerModel> Tiny(const std::string& preset) {
  auto model = CreateTransformer(*TransformerPreset(preset), DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 7;
  init.stddev = 0.3;  // large enough that attention is far from uniform
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

// The parallel init (models over InitOptions::sequential_limit parameters): the same values at any thread count,
// each parameter its own draws, N(0, stddev) matrices, norms exactly 1 unless perturbed.
TEST(InitRandomTest, ParallelDrawsAreTheSameAtAnyThreadCount) {
  auto values = [](int threads, bool perturb) {
    std::unique_ptr<TransformerModel> model = Tiny("tiny");  // drawn again below, every value
    InitOptions parallel;
    parallel.seed = 7;
    parallel.perturb_norms_and_biases = perturb;
    parallel.sequential_limit = 0;
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    InitRandom(*model, parallel);
    omp_set_num_threads(saved);
    std::vector<std::vector<double>> out;
    for (Param& p : model->params()) out.push_back(HostCopy<double>(p.value));
    return out;
  };
  const std::vector<std::vector<double>> one = values(1, false), three = values(3, false);
  EXPECT_EQ(one, three);
  const std::vector<double>& embed = one[0];  // model.embed_tokens.weight, 3104 values
  double mean = 0, sq = 0;
  for (double x : embed) mean += x / embed.size();
  for (double x : embed) sq += (x - mean) * (x - mean) / embed.size();
  EXPECT_LT(std::abs(mean), 4 * 0.02 / std::sqrt(embed.size()));
  EXPECT_NEAR(std::sqrt(sq), 0.02, 0.002);  // InitOptions' default stddev
  EXPECT_NE(std::vector<double>(one[2].begin(), one[2].begin() + 8),
            std::vector<double>(one[3].begin(), one[3].begin() + 8));  // q_proj and k_proj: their own draws
  for (double x : one[1]) ASSERT_EQ(x, 1.0);                           // input_layernorm
  const std::vector<std::vector<double>> perturbed = values(2, true);
  EXPECT_EQ(perturbed[0], one[0]);  // matrices draw the same either way
  EXPECT_NE(perturbed[1], one[1]);
  for (double x : perturbed[1]) EXPECT_NEAR(x, 1.0, 0.6);
}

// Ragged batch: lengths 23 and 9, random tokens, some labels ignored.
std::vector<Sequence> MakeBatch(int64_t vocab) { return RaggedBatch(vocab, 12345); }

struct Case {
  std::string preset, strategy;
  int64_t chunk, page_size;
};

class StrategyTest : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyTest, MatchesFullBackprop) {
  const Case& c = GetParam();
  auto model = Tiny(c.preset);
  StrategyOptions o;
  o.name = c.strategy;
  o.chunk = c.chunk;
  o.page_size = c.page_size;
  o.lm_chunk = 5;
  absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, MakeBatch(model->vocab_size()), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->params_checked, static_cast<int64_t>(model->params().size()));
  EXPECT_NEAR(r->loss, r->reference_loss, 1e-12);
  EXPECT_LE(r->max_rel_err, 1e-10) << "worst: " << r->worst_param;
}

// Chunk 23 = one chunk for the long sequence, 12 = two (ragged), 4 = six chunks plus a ragged one (7 in all);
// page sizes that do and do not divide the chunk.
INSTANTIATE_TEST_SUITE_P(Exact, StrategyTest,
                         ::testing::Values(Case{"tiny", "ckpt", 512, 4}, Case{"tiny-qwen2", "ckpt", 512, 3},
                                           Case{"tiny", "seco", 23, 8}, Case{"tiny", "seco", 12, 5},
                                           Case{"tiny", "seco", 4, 3}, Case{"tiny", "seco", 3, 16},
                                           Case{"tiny-qwen2", "seco", 4, 3}, Case{"tiny-qwen2", "seco", 1, 2},
                                           Case{"tiny", "streambp", 23, 8}, Case{"tiny", "streambp", 12, 5},
                                           Case{"tiny", "streambp", 4, 3}, Case{"tiny-qwen2", "streambp", 3, 2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.preset.substr(0, 4) + (info.param.preset.size() > 4 ? "qwen" : "") + "_" +
                                  info.param.strategy + "_chunk" + std::to_string(info.param.chunk) + "_page" +
                                  std::to_string(info.param.page_size);
                         });

// Full backprop against central differences of the batch loss on a sample of every parameter's entries.
TEST(FullBackpropTest, MatchesFiniteDifferences) {
  for (const std::string preset : {"tiny", "tiny-qwen2"}) {
    auto model = Tiny(preset);
    const std::vector<Sequence> batch = MakeBatch(model->vocab_size());
    StrategyOptions o;
    o.page_size = 4;
    Trainer trainer(*model, o, {});
    ASSERT_TRUE(trainer.ComputeGradients(batch).ok());
    std::vector<std::vector<double>> analytic;
    for (Param& p : model->params())
      analytic.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
    Trainer probe(*model, o, {});
    for (size_t k = 0; k < analytic.size(); ++k) {
      Param& p = model->params()[k];
      double* w = p.value.data<double>();
      for (int64_t i = 0; i < p.value.numel(); i += std::max<int64_t>(1, p.value.numel() / 5)) {
        const double saved = w[i], h = 1e-5;
        w[i] = saved + h;
        const double up = probe.ComputeGradients(batch)->loss;
        w[i] = saved - h;
        const double down = probe.ComputeGradients(batch)->loss;
        w[i] = saved;
        EXPECT_NEAR(analytic[k][i], (up - down) / (2 * h), 1e-7 * std::max(1.0, std::abs(analytic[k][i])))
            << preset << " " << p.name << "[" << i << "]";
      }
    }
  }
}

// With a budget of every chunk, spaco keeps all of them with probability 1 and compensates by 1: it is seco.
TEST(SpacoTest, FullBudgetIsExact) {
  for (double cap : {0.0, 2.0}) {
    auto model = Tiny("tiny");
    StrategyOptions o;
    o.name = "spaco";
    o.chunk = 4;
    o.page_size = 3;
    o.spaco_budget = 6;  // the 23-token sequence has 6 chunks
    o.spaco_cap = cap;
    const std::vector<Sequence> one{MakeBatch(model->vocab_size())[0]};
    absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, one, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(r->max_rel_err, 1e-10) << "cap " << cap << ", worst: " << r->worst_param;
  }
}

// A budget below k backpropagates a random subset, reports the loss of every chunk all the same, and draws a new
// subset on every call.
TEST(SpacoTest, SamplesASubsetAndReportsTheFullLoss) {
  auto model = Tiny("tiny");
  StrategyOptions o;
  o.name = "spaco";
  o.chunk = 2;
  o.spaco_budget = 2;
  const std::vector<Sequence> one{MakeBatch(model->vocab_size())[0]};  // 12 chunks
  Trainer reference(*model, StrategyOptions{}, {});
  const double loss = reference.ComputeGradients(one)->loss;
  Trainer trainer(*model, o, {});
  int64_t kept = 0, calls = 200;
  std::set<int64_t> counts;
  for (int i = 0; i < calls; ++i) {
    absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(one);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_NEAR(m->loss, loss, 1e-12);
    EXPECT_EQ(m->chunks, 12);
    kept += m->chunks_backpropagated;
    counts.insert(m->chunks_backpropagated);
  }
  EXPECT_NEAR(static_cast<double>(kept) / calls, 2.0, 0.4);  // Binomial(12, 1/6): mean 2, sd of the mean 0.09
  EXPECT_GT(counts.size(), 2u);
}

TEST(SpacoTest, BadOptions) {
  auto model = Tiny("tiny");
  const std::vector<Sequence> batch = MakeBatch(model->vocab_size());  // 23 and 9 tokens
  auto error = [&](StrategyOptions o) {
    Trainer trainer(*model, o, {});
    absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
    EXPECT_FALSE(m.ok());
    return m.ok() ? std::string() : std::string(m.status().message());
  };
  StrategyOptions o;
  o.name = "spaco";
  o.chunk = 4;
  o.spaco_budget = 0;
  EXPECT_NE(error(o).find("--spaco_budget must be at least 1"), std::string::npos) << error(o);
  o.spaco_budget = 4;  // the 9-token sequence has 3 chunks
  EXPECT_NE(error(o).find("--spaco_budget=4 exceeds the 3 chunks of batch sequence 1"), std::string::npos) << error(o);
  o.spaco_budget = 1;
  o.spaco_cap = 0.5;
  EXPECT_NE(error(o).find("--spaco_cap"), std::string::npos) << error(o);
  o.spaco_cap = std::nan("");
  EXPECT_NE(error(o).find("--spaco_cap"), std::string::npos) << error(o);
  o.spaco_cap = 2;
  o.page_size = 0;
  EXPECT_NE(error(o).find("--page_size must be positive"), std::string::npos) << error(o);
  o.page_size = 4;
  o.chunk = 0;
  EXPECT_NE(error(o).find("--chunk must be positive"), std::string::npos) << error(o);
  o.chunk = 1000;  // larger than the sequence: one chunk
  Trainer trainer(*model, o, {});
  EXPECT_TRUE(trainer.ComputeGradients(batch).ok());
}

// The engine's memory limit turns a step that would need more into ResourceExhausted, and leaves the model usable.
TEST(MemoryLimitTest, StepFailsCleanlyAndRecovers) {
  auto model = Tiny("tiny");
  const std::vector<Sequence> batch = MakeBatch(model->vocab_size());
  StrategyOptions o;
  o.name = "seco";
  o.chunk = 4;
  const int64_t resting = model->memory().Snapshot().total_current;
  model->memory().set_limit(resting + 1000);
  Trainer trainer(*model, o, {});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(m.status().message().find("memory limit"), std::string::npos) << m.status();
  EXPECT_EQ(model->memory().Snapshot().total_current, resting);
  model->memory().set_limit(0);
  absl::StatusOr<StepMetrics> ok = trainer.ComputeGradients(batch);
  ASSERT_TRUE(ok.ok()) << ok.status();
  // The optimizer's moments do not fit: the step fails cleanly, and succeeds once the limit is lifted.
  model->memory().set_limit(model->memory().Snapshot().total_current + 1000);
  absl::Status step = trainer.OptimizerStep(&*ok);
  EXPECT_EQ(step.code(), absl::StatusCode::kResourceExhausted) << step;
  model->memory().set_limit(0);
  EXPECT_TRUE(trainer.OptimizerStep(&*ok).ok());
}

// Evaluation without gradients gives full backprop's loss.
TEST(EvaluateLossTest, MatchesFull) {
  auto model = Tiny("tiny-qwen2");
  const std::vector<Sequence> batch = MakeBatch(model->vocab_size());
  StrategyOptions o;
  o.chunk = 5;
  o.page_size = 3;
  Trainer trainer(*model, o, {});
  const double full = trainer.ComputeGradients(batch)->loss;
  absl::StatusOr<StepMetrics> eval = trainer.EvaluateLoss(batch);
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_NEAR(eval->loss, full, 1e-12);
  EXPECT_EQ(eval->chunks, 5 + 2);
}

// Every exact strategy on every objective against full backprop (full itself is checked against PyTorch in
// //tests/torch_ref).
TEST(ObjectiveTest, StrategiesMatchFull) {
  for (const std::string objective : {"dpo", "grpo"}) {
    for (const std::string strategy : {"ckpt", "seco", "streambp"}) {
      auto model = Tiny("tiny-qwen2");
      ObjectiveOptions obj;
      obj.name = objective;
      absl::StatusOr<Batch> batch = MakeCheckBatch(*model, obj, 29, 5);
      ASSERT_TRUE(batch.ok()) << batch.status();
      StrategyOptions o;
      o.name = strategy;
      o.chunk = 6;
      o.page_size = 4;
      o.lm_chunk = 7;
      absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, *batch, o, obj);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_NEAR(r->loss, r->reference_loss, 1e-12) << objective << " " << strategy;
      EXPECT_LE(r->max_rel_err, 1e-10) << objective << " " << strategy << ", worst: " << r->worst_param;
    }
  }
}

TEST(ObjectiveTest, BadInput) {
  auto model = Tiny("tiny");
  ObjectiveOptions obj;
  obj.name = "grpo";
  Trainer trainer(*model, StrategyOptions{}, {}, obj);
  Batch empty_group;
  empty_group.groups.push_back(GrpoGroup{});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(empty_group);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("group 0 has no completions (G = 0)"), std::string::npos) << m.status();

  absl::StatusOr<Batch> batch = MakeCheckBatch(*model, obj, 20, 3);
  ASSERT_TRUE(batch.ok());
  batch->groups[0].completions[1].old_logprobs.pop_back();
  m = trainer.ComputeGradients(*batch);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("completion 1: old_logprobs has"), std::string::npos) << m.status();

  obj.name = "dpo";
  Trainer dpo(*model, StrategyOptions{}, {}, obj);
  batch = MakeCheckBatch(*model, obj, 20, 3);
  ASSERT_TRUE(batch.ok());
  batch->pairs[1].ref_rejected_logp = NAN;  // and no reference model
  m = dpo.ComputeGradients(*batch);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("pair 1 has no reference log-probs"), std::string::npos) << m.status();
  batch->pairs[0].chosen.labels.assign(batch->pairs[0].chosen.labels.size(), -100);
  m = dpo.ComputeGradients(*batch);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("pair 0 chosen: batch has no valid labels"), std::string::npos) << m.status();

  obj.name = "ppo";
  Trainer unknown(*model, StrategyOptions{}, {}, obj);
  EXPECT_NE(unknown.ComputeGradients(*batch).status().message().find("unknown objective 'ppo'"), std::string::npos);
  StrategyOptions zero;
  zero.name = "streambp";
  zero.chunk = 0;
  obj.name = "sft";
  Trainer zero_partition(*model, zero, {}, obj);
  EXPECT_NE(zero_partition.ComputeGradients(MakeBatch(model->vocab_size()))
                .status()
                .message()
                .find("--chunk must be positive"),
            std::string::npos);
}

}  // namespace
}  // namespace sg
