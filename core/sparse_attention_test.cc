// Page-level sparse attention (StateOptions::sparse_pages, SeCOv2 §4.3) on the CPU backend, in fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/gradcheck.h"
#include "core/presets.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "core/transformer.h"

namespace sg {
namespace {

std::unique_ptr<TransformerModel> Tiny() {
  auto model = CreateTransformer(*TransformerPreset("tiny"), DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 7;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

// Lengths 23 and 9; with page 2 and chunk 4 the last chunk of the long sequence has 8 candidate pages.
std::vector<Sequence> Batch(int64_t vocab) { return RaggedBatch(vocab, 12345); }

StrategyOptions Seco(int64_t k) {
  StrategyOptions o;
  o.name = "seco";
  o.chunk = 4;
  o.page_size = 2;
  o.lm_chunk = 5;
  o.sparse_pages = k;
  return o;
}

std::vector<std::vector<double>> Grads(Model& m, const StrategyOptions& o, const std::vector<Sequence>& b,
                                       double* loss) {
  Trainer t(m, o, {});
  auto r = t.ComputeGradients(b);
  EXPECT_TRUE(r.ok()) << r.status();
  *loss = r->loss;
  std::vector<std::vector<double>> g;
  for (Param& p : m.params()) g.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
  return g;
}

double MaxDiff(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) worst = std::max(worst, std::abs(a[i][j] - b[i][j]));
  return worst;
}

// k at least the number of candidate pages: exactly the dense gradients.
TEST(SparsePagesTest, LargeBudgetIsDense) {
  for (int64_t k : {8, 100}) {
    auto model = Tiny();
    auto r = CheckAgainstFull(*model, Batch(model->vocab_size()), Seco(k));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->loss, r->reference_loss, 1e-12);
    EXPECT_LE(r->max_abs_err, 1e-12) << "k " << k << " worst: " << r->worst_param;
  }
}

// Small k: a different model (loss and gradients move), deterministic (bit-identical on a second call), and its
// gradients are the exact gradients of the sparse loss (central differences of seco's sparse loss).
TEST(SparsePagesTest, SmallBudgetIsExactGradientOfSparseModel) {
  auto model = Tiny();
  const std::vector<Sequence> batch = Batch(model->vocab_size());
  double dense_loss = 0, loss = 0, again_loss = 0;
  const auto dense = Grads(*model, Seco(0), batch, &dense_loss);
  for (int64_t k : {1, 3}) {
    const auto sparse = Grads(*model, Seco(k), batch, &loss);
    const auto again = Grads(*model, Seco(k), batch, &again_loss);
    EXPECT_EQ(loss, again_loss);
    EXPECT_EQ(MaxDiff(sparse, again), 0.0);
    EXPECT_GT(std::abs(loss - dense_loss), 1e-9) << "k " << k;
    EXPECT_GT(MaxDiff(sparse, dense), 1e-9) << "k " << k;
    Trainer probe(*model, Seco(k), {});
    for (size_t p = 0; p < sparse.size(); ++p) {
      Param& param = model->params()[p];
      double* w = param.value.data<double>();
      for (int64_t i = 0; i < param.value.numel(); i += std::max<int64_t>(1, param.value.numel() / 4)) {
        const double saved = w[i], h = 1e-5;
        w[i] = saved + h;
        const double up = probe.ComputeGradients(batch)->loss;
        w[i] = saved - h;
        const double down = probe.ComputeGradients(batch)->loss;
        w[i] = saved;
        EXPECT_NEAR(sparse[p][i], (up - down) / (2 * h), 1e-7 * std::max(1.0, std::abs(sparse[p][i])))
            << "k " << k << " " << param.name << "[" << i << "]";
      }
    }
  }
}

TEST(SparsePagesTest, BadOptions) {
  StrategyOptions o = Seco(-1);
  EXPECT_FALSE(ValidateStrategyOptions(o).ok());
  o = Seco(2);
  o.name = "streambp";
  EXPECT_FALSE(ValidateStrategyOptions(o).ok());
  o.name = "seco";
  EXPECT_TRUE(ValidateStrategyOptions(o).ok());
}

}  // namespace
}  // namespace sg
