// Runs under `mpirun -np 2` (layer_sharded_mpi_test): layer-sharded adjoint on 2 ranks against the single-process
// adjoint strategy (each rank computes the reference itself on its own copy of the model), fp64: Mamba-1 (tiny-ssm),
// and the transformer family's Mamba-2 layers (tiny-mamba2; tiny-bamba's beside attention and MLPs).
#include "distributed/layer_sharded.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "distributed/mpi_gtest_main.h"

namespace sg::dist {
namespace {

std::unique_ptr<Model> MakeSsm(int layers, bool tied) {
  MambaConfig c = *MambaPreset("tiny-ssm");
  c.num_layers = layers;
  c.tie_word_embeddings = tied;
  auto model = CreateMamba(c, DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  init.seed = 11;
  InitRandom(**model, init);
  return std::move(*model);
}

struct Case {
  int layers;
  bool tied;
  std::string form;
  int64_t window;  // 0: none
  int64_t chunk;
  std::string preset = "tiny-ssm";  // or a transformer preset with Mamba-2 layers (its own layers and head)
};

std::unique_ptr<Model> MakeModel(const Case& c) {
  if (c.preset == "tiny-ssm") return MakeSsm(c.layers, c.tied);
  auto model = CreateTransformer(*TransformerPreset(c.preset), DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  init.seed = 11;
  InitRandom(**model, init);
  return std::move(*model);
}

std::vector<Sequence> Batch2(int64_t vocab) {
  std::vector<Sequence> b = RaggedBatch(vocab, 12345);  // 23 and 9 tokens
  b[1].labels[0] = -100;
  return b;
}

StrategyOptions Options(const Case& c) {
  StrategyOptions o;
  o.name = "adjoint";
  o.adjoint_form = c.form;
  if (c.window > 0) o.adjoint_window = c.window;
  o.chunk = c.chunk;
  o.page_size = 4;
  o.seed = 5;
  return o;
}

class LayerShardedTest : public ::testing::TestWithParam<Case> {};

TEST_P(LayerShardedTest, GradientsEqualSingleProcessAdjoint) {
  const Case& c = GetParam();
  auto single = MakeModel(c), sharded = MakeModel(c);
  Trainer reference(*single, Options(c), OptimizerOptions{});
  LayerShardedAdjoint ls(*sharded, Options(c), OptimizerOptions{}, *g_comm);
  ASSERT_TRUE(ls.Validate().ok()) << ls.Validate();
  const std::vector<Sequence> batch = Batch2(single->vocab_size());
  absl::StatusOr<StepMetrics> want = reference.ComputeGradients(batch);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<StepMetrics> got = ls.ComputeGradients(batch);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(got->loss, want->loss, 1e-12);
  EXPECT_EQ(got->tokens, want->tokens);
  EXPECT_EQ(got->chunks, want->chunks);
  EXPECT_EQ(got->adjoint_pairs, want->adjoint_pairs);
  double worst = 0, others = 0;
  int owned = 0;
  for (size_t i = 0; i < single->params().size(); ++i) {
    const Param &p = single->params()[i], &q = sharded->params()[i];
    if (!p.grad.defined()) continue;
    const bool mine = ls.OwnerOf(i) == g_comm->rank();
    owned += mine;
    for (int64_t k = 0; k < p.grad.numel(); ++k) {
      const double a = p.grad.data<double>()[k], b = q.grad.data<double>()[k];
      if (mine)
        worst = std::max(worst, std::abs(a - b));
      else
        others = std::max(others, std::abs(b));
    }
  }
  std::vector<double> all = {worst};
  ASSERT_TRUE(g_comm->AllReduce(all, ReduceOp::kMax).ok());
  EXPECT_GT(owned, 0);
  EXPECT_LE(worst, 1e-10) << "owned gradients on rank " << g_comm->rank();
  EXPECT_EQ(others, 0.0) << "a rank accumulated into parameters it does not own";
  std::printf(
      "rank %d (layers [%d, %d) of %d, %s, form %s, window %lld, chunk %lld): loss %.17g vs %.17g, "
      "max |grad diff| %.3g (all ranks %.3g), %lld bytes sent\n",
      g_comm->rank(), ls.block().begin, ls.block().end, c.layers, c.tied ? "tied" : "untied", c.form.c_str(),
      static_cast<long long>(c.window), static_cast<long long>(c.chunk), got->loss, want->loss, worst, all[0],
      static_cast<long long>(ls.bytes_last_step()));
}

TEST_P(LayerShardedTest, TrainingEqualsSingleProcess) {
  const Case& c = GetParam();
  auto single = MakeModel(c), sharded = MakeModel(c);
  OptimizerOptions opt;
  opt.lr = 3e-3;
  opt.weight_decay = 0.1;
  opt.clip_grad_norm = 0.5;
  Trainer reference(*single, Options(c), opt);
  LayerShardedAdjoint ls(*sharded, Options(c), opt, *g_comm);
  const std::vector<Sequence> batch = Batch2(single->vocab_size());
  for (int step = 1; step <= 3; ++step) {
    absl::StatusOr<StepMetrics> want = reference.Step(batch);
    absl::StatusOr<StepMetrics> got = ls.Step(batch);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << " " << got.status();
    EXPECT_NEAR(got->loss, want->loss, 1e-11 * std::abs(want->loss)) << "step " << step;
    EXPECT_NEAR(got->grad_norm, want->grad_norm, 1e-10) << "step " << step;
  }
  // Every rank holds the full, updated model.
  double worst = 0;
  for (size_t i = 0; i < single->params().size(); ++i) {
    const Tensor &a = single->params()[i].value, &b = sharded->params()[i].value;
    for (int64_t k = 0; k < a.numel(); ++k)
      worst = std::max(worst, std::abs(a.data<double>()[k] - b.data<double>()[k]));
  }
  EXPECT_LE(worst, 1e-10) << "weights after 3 steps";
  // Moments only for owned parameters: less optimizer memory than one process.
  int64_t mine = 0;
  for (const Tensor& m : ls.optimizer().m()) mine += m.defined() ? static_cast<int64_t>(m.nbytes()) : 0;
  int64_t full = 0;
  for (const Tensor& m : reference.optimizer().m()) full += m.defined() ? static_cast<int64_t>(m.nbytes()) : 0;
  EXPECT_LT(mine, full);
  std::printf("rank %d: weights after 3 steps max diff %.3g; first-moment bytes %lld of %lld\n", g_comm->rank(), worst,
              static_cast<long long>(mine), static_cast<long long>(full));
}

INSTANTIATE_TEST_SUITE_P(Forms, LayerShardedTest,
                         ::testing::Values(Case{3, true, "pairs", 0, 4}, Case{3, true, "pairs", 3, 4},
                                           Case{3, true, "scan", 0, 5}, Case{2, true, "pairs", 0, 4},
                                           Case{2, false, "pairs", 5, 7}, Case{3, false, "scan", 0, 64},
                                           Case{3, true, "pairs", 0, 4, "tiny-mamba2"},
                                           Case{3, false, "pairs", 3, 5, "tiny-bamba"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           std::string preset = c.preset.substr(5);
                           return absl::StrCat(preset, "_L", c.layers, c.tied ? "_tied_" : "_untied_", c.form, "_w",
                                               c.window, "_c", c.chunk);
                         });

TEST(LayerSharded, BlocksAreContiguousAndUneven) {
  EXPECT_EQ(LayerBlockOf(3, 0, 2)->begin, 0);
  EXPECT_EQ(LayerBlockOf(3, 0, 2)->end, 1);
  EXPECT_EQ(LayerBlockOf(3, 1, 2)->begin, 1);
  EXPECT_EQ(LayerBlockOf(3, 1, 2)->end, 3);
  EXPECT_EQ(LayerBlockOf(5, 2, 3)->begin, 3);
  EXPECT_EQ(LayerBlockOf(5, 2, 3)->end, 5);
}

TEST(LayerSharded, MoreRanksThanLayersIsRefused) {
  const absl::StatusOr<LayerBlock> b = LayerBlockOf(1, 0, 2);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("world size 2 exceeds the model's 1 layers"), std::string::npos) << b.status();
  auto model = MakeSsm(1, true);
  StrategyOptions o;
  o.name = "adjoint";
  LayerShardedAdjoint ls(*model, o, OptimizerOptions{}, *g_comm);
  if (g_comm->size() > 1) {
    EXPECT_EQ(ls.Validate().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ls.ComputeGradients(Batch2(model->vocab_size())).status().code(), absl::StatusCode::kInvalidArgument);
  }
  o.adjoint_form = "paper";
  auto m3 = MakeSsm(3, true);
  LayerShardedAdjoint paper(*m3, o, OptimizerOptions{}, *g_comm);
  EXPECT_NE(paper.Validate().message().find("paper"), std::string::npos) << paper.Validate();
}

}  // namespace
}  // namespace sg::dist
