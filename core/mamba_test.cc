// Mamba-1 (tiny-ssm, fp64): every exact strategy against full backprop with ragged chunks, full backprop against
// finite differences of the loss, and an objective through HeadLoss.
#include <gtest/gtest.h>

#include <cmath>

#include "core/data.h"
#include "core/gradcheck.h"
#include "core/mamba.h"
#include "core/presets.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "core/transformer.h"

namespace sg {
namespace {

std::unique_ptr<MambaModel> TinySsm(bool tied = true, bool biases = false) {
  MambaConfig config = *MambaPreset("tiny-ssm");
  config.tie_word_embeddings = tied;
  config.use_bias = biases;
  auto model = CreateMamba(config, DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 11;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

// Lengths 23 and 9, random tokens, some labels ignored.
std::vector<Sequence> MakeBatch(int64_t vocab) { return RaggedBatch(vocab, 999); }

struct Case {
  std::string strategy;
  int64_t chunk;
  bool tied;
};

class MambaStrategyTest : public ::testing::TestWithParam<Case> {};

TEST_P(MambaStrategyTest, MatchesFullBackprop) {
  const Case& c = GetParam();
  auto model = TinySsm(c.tied, !c.tied);
  StrategyOptions o;
  o.name = c.strategy;
  o.chunk = c.chunk;
  o.lm_chunk = 5;
  absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, MakeBatch(model->vocab_size()), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->params_checked, static_cast<int64_t>(model->params().size()));
  EXPECT_NEAR(r->loss, r->reference_loss, 1e-12);
  EXPECT_LE(r->max_rel_err, 1e-10) << "worst: " << r->worst_param;
}

// Chunks of 1 and 2 are shorter than the conv tail (3); 7 leaves a ragged last chunk; 23 is one chunk.
INSTANTIATE_TEST_SUITE_P(
    Exact, MambaStrategyTest,
    ::testing::Values(Case{"ckpt", 512, true}, Case{"ckpt", 512, false}, Case{"seco", 1, true},
                      Case{"seco", 2, false}, Case{"seco", 7, true}, Case{"seco", 23, true},
                      Case{"streambp", 1, true}, Case{"streambp", 2, true}, Case{"streambp", 7, false},
                      Case{"streambp", 5, true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return info.param.strategy + "_chunk" + std::to_string(info.param.chunk) + (info.param.tied ? "_tied" : "_untied");
    });

TEST(MambaFullBackpropTest, MatchesFiniteDifferences) {
  for (bool tied : {true, false}) {
    auto model = TinySsm(tied, !tied);
    const std::vector<Sequence> batch = MakeBatch(model->vocab_size());
    Trainer trainer(*model, StrategyOptions{}, {});
    ASSERT_TRUE(trainer.ComputeGradients(batch).ok());
    std::vector<std::vector<double>> analytic;
    for (Param& p : model->params())
      analytic.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
    Trainer probe(*model, StrategyOptions{}, {});
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
            << p.name << "[" << i << "]";
      }
    }
  }
}

TEST(MambaObjectiveTest, DpoStrategiesMatchFull) {
  for (const std::string strategy : {"ckpt", "seco", "streambp"}) {
    auto model = TinySsm();
    ObjectiveOptions obj;
    obj.name = "dpo";
    absl::StatusOr<Batch> batch = MakeCheckBatch(*model, obj, 29, 5);
    ASSERT_TRUE(batch.ok()) << batch.status();
    StrategyOptions o;
    o.name = strategy;
    o.chunk = 6;
    o.lm_chunk = 7;
    absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, *batch, o, obj);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->loss, r->reference_loss, 1e-12) << strategy;
    EXPECT_LE(r->max_rel_err, 1e-10) << strategy << ", worst: " << r->worst_param;
  }
}

// State memory does not grow with the sequence, and a layer beyond the resident ones is refused.
TEST(MambaStateTest, ResidentLayersAndStateBytes) {
  auto model = TinySsm();
  EXPECT_EQ(model->StateBytesPerToken(), 0);
  EXPECT_EQ(model->family(), "ssm");
  auto state = model->NewState({/*seq_len=*/8, /*page_size=*/4, /*resident_layers=*/1, /*resident_grad_layers=*/1});
  const int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  Tensor x = model->Embed(ids, {0, 4});
  Tensor y = model->LayerForward(0, {0, 4}, x, *state, nullptr);
  EXPECT_THROW(model->LayerForward(1, {0, 4}, y, *state, nullptr), std::runtime_error);
  state->Release(0, 0);
  EXPECT_NO_THROW(model->LayerForward(1, {0, 4}, y, *state, nullptr));
}

}  // namespace
}  // namespace sg
