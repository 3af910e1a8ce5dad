// Page-level sparse attention (StateOptions::sparse_pages, SeCOv2 §4.3) on the CPU backend, in fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/gradcheck.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "kernels/backend.h"

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

// The page scores come from two ops (OpTable::column_sums_f64, page_scores) that run on the model's device; on the
// CPU they give the bits of the host loops SelectPages used before (key sums per page and query sums in f64, the
// mean query per KV head, dot products), so the selection is unchanged, in f32 and f64.
template <typename T>
void ExpectScoresOfHostLoops() {
  const int64_t H = 6, G = 2, hd = 5, group = H / G, ps = 3, pages = 7, n = 4, kvd = G * hd;
  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal;
  std::vector<T> keys(pages * ps * kvd), q(n * H * hd);
  for (T& x : keys) x = static_cast<T>(normal(rng));
  for (T& x : q) x = static_cast<T>(normal(rng));
  // The host loops as they were.
  std::vector<double> sums(pages * kvd, 0.0), mq(H * hd, 0.0), gq(kvd, 0.0), want(pages - 1);
  for (int64_t p = 0; p < pages; ++p)
    for (int64_t r = 0; r < ps; ++r)
      for (int64_t e = 0; e < kvd; ++e) sums[p * kvd + e] += static_cast<double>(keys[(p * ps + r) * kvd + e]);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < H * hd; ++e) mq[e] += static_cast<double>(q[i * H * hd + e]);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t e = 0; e < hd; ++e) gq[(h / group) * hd + e] += mq[h * hd + e] / static_cast<double>(n);
  for (int64_t p = 1; p < pages; ++p) {
    double acc = 0;
    for (int64_t e = 0; e < kvd; ++e) acc += gq[e] * sums[p * kvd + e];
    want[p - 1] = acc / static_cast<double>(ps);
  }
  const OpTable<T>& ops = CpuOps<T>();
  std::vector<double> got_sums(pages * kvd), q_sums(H * hd), got(pages - 1);
  for (int64_t p = 0; p < pages; ++p)
    ops.column_sums_f64(keys.data() + p * ps * kvd, ps, kvd, got_sums.data() + p * kvd);
  ops.column_sums_f64(q.data(), n, H * hd, q_sums.data());
  ops.page_scores(q_sums.data(), n, H, G, hd, got_sums.data(), 1, pages - 1, ps, got.data());
  EXPECT_EQ(got_sums, sums);
  EXPECT_EQ(q_sums, mq);
  EXPECT_EQ(got, want);
}

TEST(SparsePagesTest, ScoresAreTheHostLoopsBits) {
  ExpectScoresOfHostLoops<float>();
  ExpectScoresOfHostLoops<double>();
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
