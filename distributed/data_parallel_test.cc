// Runs under `mpirun -np 2` (data_parallel_mpi_test.sh): data-parallel gradients and training on 2 ranks against
// one process on the whole batch (each rank also computes the single-process reference itself, on its own copy
// of the model), the configuration check, and failure agreement.
#include "distributed/data_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "core/gradcheck.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "distributed/mpi_gtest_main.h"

namespace sg::dist {
namespace {

std::unique_ptr<Model> MakeModel(const std::string& preset) {
  InitOptions init;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  if (preset == "tiny-ssm") {
    auto model = CreateMamba(*MambaPreset(preset), DType::kF64);
    EXPECT_TRUE(model.ok()) << model.status();
    init.seed = 11;
    InitRandom(**model, init);
    return std::move(*model);
  }
  auto model = CreateTransformer(*TransformerPreset(preset), DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  init.seed = 7;
  InitRandom(**model, init);
  return std::move(*model);
}

// Four ragged sequences (23, 9, 23, 9 tokens, different valid-label counts per shard).
Batch WholeBatch(int64_t vocab) {
  Batch b;
  for (uint64_t seed : {12345u, 777u}) {
    std::vector<Sequence> part = RaggedBatch(vocab, seed);
    b.sequences.insert(b.sequences.end(), part.begin(), part.end());
  }
  b.sequences[3].labels[0] = -100;  // shards differ in their number of valid labels
  return b;
}

double MaxGradDiff(Model& a, Model& b) {
  double worst = 0;
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param &p = a.params()[i], &q = b.params()[i];
    if (!p.grad.defined()) continue;
    for (int64_t k = 0; k < p.grad.numel(); ++k)
      worst = std::max(worst, std::abs(p.grad.data<double>()[k] - q.grad.data<double>()[k]));
  }
  return worst;
}

struct Case {
  std::string preset, strategy;
  int64_t chunk, page_size;
};

StrategyOptions Options(const Case& c) {
  StrategyOptions o;
  o.name = c.strategy;
  o.chunk = c.chunk;
  o.page_size = c.page_size;
  o.spaco_budget = 2;
  o.seed = 5;
  return o;
}

class DataParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallelTest, GradientsEqualSingleProcessOnWholeBatch) {
  const Case& c = GetParam();
  auto single = MakeModel(c.preset), parallel = MakeModel(c.preset);
  Trainer reference(*single, Options(c), OptimizerOptions{});
  Trainer local(*parallel, Options(c), OptimizerOptions{});
  DataParallel dp(local, *g_comm);
  ASSERT_TRUE(dp.CheckConfig().ok());
  const Batch whole = WholeBatch(single->vocab_size());
  absl::StatusOr<StepMetrics> want = reference.ComputeGradients(whole);
  ASSERT_TRUE(want.ok()) << want.status();
  uint64_t first = 0;
  const Batch shard = ShardOf(whole, g_comm->rank(), g_comm->size(), &first);
  absl::StatusOr<StepMetrics> got = dp.ComputeGradients(shard, first);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(got->loss, want->loss, 1e-12);
  EXPECT_EQ(got->tokens, want->tokens);
  EXPECT_EQ(got->chunks, want->chunks);
  EXPECT_EQ(got->chunks_backpropagated, want->chunks_backpropagated);
  const double diff = MaxGradDiff(*single, *parallel);
  EXPECT_LE(diff, 1e-10) << c.strategy << ": max |grad diff| " << diff;
  std::printf("rank %d %s/%s: loss %.17g vs %.17g, max |grad diff| %.3g, %lld bytes all-reduced\n", g_comm->rank(),
              c.preset.c_str(), c.strategy.c_str(), got->loss, want->loss, diff,
              static_cast<long long>(dp.bytes_last_step()));
}

TEST_P(DataParallelTest, TrainingLossEqualsSingleProcess) {
  const Case& c = GetParam();
  auto single = MakeModel(c.preset), parallel = MakeModel(c.preset);
  OptimizerOptions opt;
  opt.lr = 3e-3;
  Trainer reference(*single, Options(c), opt);
  Trainer local(*parallel, Options(c), opt);
  DataParallel dp(local, *g_comm);
  const Batch whole = WholeBatch(single->vocab_size());
  uint64_t first = 0;
  const Batch shard = ShardOf(whole, g_comm->rank(), g_comm->size(), &first);
  for (int step = 1; step <= 4; ++step) {
    absl::StatusOr<StepMetrics> want = reference.Step(whole);
    absl::StatusOr<StepMetrics> got = dp.Step(shard, first);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << " " << got.status();
    EXPECT_NEAR(got->loss, want->loss, 1e-11 * std::abs(want->loss)) << "step " << step;
    EXPECT_NEAR(got->grad_norm, want->grad_norm, 1e-10) << "step " << step;
    // Every rank holds the same loss, bit for bit.
    std::vector<double> mine = {got->loss}, top = {got->loss};
    ASSERT_TRUE(g_comm->AllReduce(top, ReduceOp::kMax).ok());
    EXPECT_EQ(mine[0], top[0]);
  }
  double worst = 0;
  for (size_t i = 0; i < single->params().size(); ++i) {
    const Tensor &a = single->params()[i].value, &b = parallel->params()[i].value;
    for (int64_t k = 0; k < a.numel(); ++k)
      worst = std::max(worst, std::abs(a.data<double>()[k] - b.data<double>()[k]));
  }
  EXPECT_LE(worst, 1e-10) << "weights after 4 steps";
}

INSTANTIATE_TEST_SUITE_P(Strategies, DataParallelTest,
                         ::testing::Values(Case{"tiny", "full", 512, 4}, Case{"tiny", "ckpt", 512, 4},
                                           Case{"tiny", "seco", 4, 3}, Case{"tiny-qwen2", "seco", 5, 2},
                                           Case{"tiny", "streambp", 4, 3}, Case{"tiny", "spaco", 4, 3},
                                           Case{"tiny-ssm", "adjoint", 4, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.preset + "_" + info.param.strategy;
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

// dpo normalises by pairs, grpo by groups: 2 pairs / 2 groups (+ a third record) split over the ranks.
TEST(DataParallel, DpoAndGrpoGradientsEqualSingleProcess) {
  for (const std::string name : {"dpo", "grpo"}) {
    auto single = MakeModel("tiny"), parallel = MakeModel("tiny");
    ObjectiveOptions obj;
    obj.name = name;
    StrategyOptions o;
    o.name = "seco";
    o.chunk = 5;
    Batch whole;
    for (uint64_t seed : {3u, 4u}) {
      absl::StatusOr<Batch> b = MakeCheckBatch(*single, obj, 17, seed);
      ASSERT_TRUE(b.ok()) << b.status();
      whole.pairs.insert(whole.pairs.end(), b->pairs.begin(), b->pairs.end());
      whole.groups.insert(whole.groups.end(), b->groups.begin(), b->groups.end());
    }
    if (name == "dpo") whole.pairs.push_back(whole.pairs[0]);  // 3 pairs: uneven shards
    Trainer reference(*single, o, OptimizerOptions{}, obj);
    Trainer local(*parallel, o, OptimizerOptions{}, obj);
    DataParallel dp(local, *g_comm);
    absl::StatusOr<StepMetrics> want = reference.ComputeGradients(whole);
    ASSERT_TRUE(want.ok()) << want.status();
    uint64_t first = 0;
    absl::StatusOr<StepMetrics> got =
        dp.ComputeGradients(ShardOf(whole, g_comm->rank(), g_comm->size(), &first), first);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_NEAR(got->loss, want->loss, 1e-12) << name;
    const double diff = MaxGradDiff(*single, *parallel);
    EXPECT_LE(diff, 1e-10) << name;
    std::printf("rank %d tiny/seco/%s: loss %.17g vs %.17g, max |grad diff| %.3g\n", g_comm->rank(), name.c_str(),
                got->loss, want->loss, diff);
  }
}

// ZeRO-1: moments only for this rank's parameters; the weights after 4 steps equal unsharded data parallel.
TEST(DataParallel, ShardedOptimizerStateEqualsUnsharded) {
  for (const std::string preset : {"tiny", "tiny-ssm"}) {
    auto plain = MakeModel(preset), sharded = MakeModel(preset);
    OptimizerOptions opt;
    opt.lr = 3e-3;
    opt.weight_decay = 0.1;
    opt.clip_grad_norm = 0.5;
    StrategyOptions o;
    o.name = preset == "tiny" ? "seco" : "adjoint";
    o.chunk = 4;
    Trainer a(*plain, o, opt), b(*sharded, o, opt);
    DataParallel dp(a, *g_comm), zero(b, *g_comm);
    zero.set_shard_optimizer(true);
    const Batch whole = WholeBatch(plain->vocab_size());
    uint64_t first = 0;
    const Batch shard = ShardOf(whole, g_comm->rank(), g_comm->size(), &first);
    for (int step = 1; step <= 4; ++step) {
      absl::StatusOr<StepMetrics> want = dp.Step(shard, first), got = zero.Step(shard, first);
      ASSERT_TRUE(want.ok() && got.ok()) << want.status() << " " << got.status();
      EXPECT_EQ(got->loss, want->loss) << "step " << step;
      EXPECT_EQ(got->grad_norm, want->grad_norm) << "step " << step;
    }
    double worst = 0;
    for (size_t i = 0; i < plain->params().size(); ++i) {
      const Tensor &x = plain->params()[i].value, &y = sharded->params()[i].value;
      for (int64_t k = 0; k < x.numel(); ++k)
        worst = std::max(worst, std::abs(x.data<double>()[k] - y.data<double>()[k]));
    }
    EXPECT_LE(worst, 1e-12) << preset << ": weights after 4 steps";
    int64_t full = 0, mine = 0;
    for (const Tensor& m : a.optimizer().m()) full += m.defined() ? 2 * static_cast<int64_t>(m.nbytes()) : 0;
    for (const Tensor& m : b.optimizer().m()) mine += m.defined() ? 2 * static_cast<int64_t>(m.nbytes()) : 0;
    std::vector<int64_t> sum = {mine}, most = {mine};
    ASSERT_TRUE(g_comm->AllReduce(sum).ok());
    ASSERT_TRUE(g_comm->AllReduce(most, ReduceOp::kMax).ok());
    EXPECT_EQ(sum[0], full) << "every moment is held by exactly one rank";
    const double share = static_cast<double>(most[0]) / static_cast<double>(full);
    EXPECT_LE(share, 1.5 / g_comm->size()) << preset << ": the largest rank's share of optimizer memory";
    std::printf(
        "rank %d %s ZeRO-1: weights max diff %.3g after 4 steps; moments %lld bytes of %lld (largest rank "
        "%.3f of the whole, 1/W = %.3f)\n",
        g_comm->rank(), preset.c_str(), worst, static_cast<long long>(mine), static_cast<long long>(full), share,
        1.0 / g_comm->size());
  }
}

TEST(DataParallel, EmptyShardWhenFewerRecordsThanRanks) {
  auto single = MakeModel("tiny"), parallel = MakeModel("tiny");
  StrategyOptions o;
  o.name = "seco";
  o.chunk = 4;
  Trainer reference(*single, o, OptimizerOptions{});
  Trainer local(*parallel, o, OptimizerOptions{});
  DataParallel dp(local, *g_comm);
  Batch whole;
  whole.sequences = {RaggedBatch(single->vocab_size(), 3)[0]};
  ASSERT_TRUE(reference.ComputeGradients(whole).ok());
  uint64_t first = 0;
  absl::StatusOr<StepMetrics> got = dp.ComputeGradients(ShardOf(whole, g_comm->rank(), g_comm->size(), &first), first);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(MaxGradDiff(*single, *parallel), 1e-10);
}

TEST(DataParallel, MismatchedConfigFailsOnEveryRank) {
  auto model = MakeModel("tiny");
  StrategyOptions o;
  o.name = "seco";
  o.chunk = g_comm->rank() == 1 ? 256 : 512;
  Trainer t(*model, o, OptimizerOptions{});
  DataParallel dp(t, *g_comm);
  const absl::Status s = dp.CheckConfig();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("configuration differs across ranks"), std::string::npos) << s;
  if (g_comm->rank() == 1) {
    EXPECT_NE(s.message().find("strategy.chunk: rank 1 '256', rank 0 '512'"), std::string::npos) << s;
  }
  std::printf("rank %d: %s\n", g_comm->rank(), s.ToString().c_str());
}

TEST(DataParallel, AFailingRankFailsEveryRank) {
  auto model = MakeModel("tiny");
  Trainer t(*model, StrategyOptions{}, OptimizerOptions{});
  DataParallel dp(t, *g_comm);
  Batch whole = WholeBatch(model->vocab_size());
  whole.sequences.back().ids[2] = 100000;  // out of the vocabulary, in the last rank's shard
  uint64_t first = 0;
  absl::StatusOr<StepMetrics> got = dp.ComputeGradients(ShardOf(whole, g_comm->rank(), g_comm->size(), &first), first);
  ASSERT_FALSE(got.ok());
  if (g_comm->rank() == g_comm->size() - 1) {
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  } else {
    EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
    EXPECT_NE(got.status().message().find(absl::StrCat("failed on rank ", g_comm->size() - 1)), std::string::npos)
        << got.status();
  }
  // The communicator still works afterwards.
  EXPECT_TRUE(g_comm->Barrier().ok());
}

TEST(Communicator, Collectives) {
  const int r = g_comm->rank(), n = g_comm->size();
  std::vector<float> f = {1.5f * (r + 1), -1.0f};
  ASSERT_TRUE(g_comm->AllReduce(f.data(), 2, DType::kF32).ok());
  EXPECT_EQ(f[0], 1.5f * n * (n + 1) / 2);
  EXPECT_EQ(f[1], -1.0f * n);
  std::vector<double> send(2 * n), recv(2);
  for (int i = 0; i < 2 * n; ++i) send[i] = i + 10 * r;
  ASSERT_TRUE(g_comm->ReduceScatter(send.data(), recv.data(), 2, DType::kF64).ok());
  EXPECT_EQ(recv[0], n * (2 * r) + 10.0 * n * (n - 1) / 2);
  std::vector<int64_t> mine = {r * 7 + 1}, all(n);
  ASSERT_TRUE(g_comm->AllGather(mine.data(), all.data(), 1, DType::kI64).ok());
  for (int i = 0; i < n; ++i) EXPECT_EQ(all[i], i * 7 + 1);
  int32_t root_value = r == n - 1 ? 42 : 0;
  ASSERT_TRUE(g_comm->Broadcast(&root_value, 1, DType::kI32, n - 1).ok());
  EXPECT_EQ(root_value, 42);
  if (n >= 2) {
    double v = 3.25;
    if (r == 0) {
      ASSERT_TRUE(g_comm->Send(&v, 1, DType::kF64, 1, 7).ok());
    }
    if (r == 1) {
      double got = 0;
      ASSERT_TRUE(g_comm->Recv(&got, 1, DType::kF64, 0, 7).ok());
      EXPECT_EQ(got, 3.25);
    }
  }
  EXPECT_EQ(g_comm->AllReduce(f.data(), 1, DType::kBF16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g_comm->Broadcast(f.data(), 1, DType::kF32, n).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(g_comm->Barrier().ok());
}

}  // namespace
}  // namespace sg::dist
