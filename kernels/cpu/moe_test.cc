// The mixture-of-experts ops (kernels/cpu/moe.cc): the router's softmax and top-k order (near and exact ties), its
// gradient against central finite differences in fp64 (with and without renormalisation, with the load-balancing
// term), the row gathers and scatters, the row dots, and f32 against f64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"

namespace sg {
namespace {

using testing_fd::Dot;
using testing_fd::FiniteDifferenceError;
using testing_fd::MaxDiff;
using testing_fd::Random;
using testing_fd::RelErr;
using testing_fd::Vec;

const OpTable<double>& ops = CpuOps<double>();
const double kNan = std::numeric_limits<double>::quiet_NaN();

struct Route {
  Vec probs, weights;
  std::vector<int32_t> top;
};

// Outputs NaN- or -1-filled: each must be assigned.
Route RunRoute(const Vec& logits, int64_t experts, int64_t k, bool normalize) {
  const int64_t n = logits.size() / experts;
  Route r{Vec(n * experts, kNan), Vec(n * k, kNan), std::vector<int32_t>(n * k, -1)};
  ops.moe_route(logits.data(), n, experts, k, normalize, r.probs.data(), r.top.data(), r.weights.data());
  return r;
}

Vec RunBackward(const Route& r, const Vec& dweights, int64_t experts, int64_t k, bool normalize, const Vec* extra) {
  const int64_t n = r.probs.size() / experts;
  Vec dlogits(n * experts, kNan);
  ops.moe_route_backward(dweights.data(), r.probs.data(), r.top.data(), n, experts, k, normalize,
                         extra ? extra->data() : nullptr, dlogits.data());
  return dlogits;
}

// Logits of n rows whose probabilities are at least ~0.1 apart relative, in a shuffled order: finite differences
// never change the selection.
Vec SpacedLogits(int64_t n, int64_t experts, uint64_t seed) {
  const Vec noise = Random(n * experts, seed, 0.02);
  Vec logits(n * experts);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> rank(experts);
    std::iota(rank.begin(), rank.end(), 0);
    std::rotate(rank.begin(), rank.begin() + (seed + 3 * i) % experts, rank.end());
    if (i % 2) std::reverse(rank.begin(), rank.end());
    for (int64_t e = 0; e < experts; ++e) logits[i * experts + e] = 0.3 * rank[e] - 1 + noise[i * experts + e];
  }
  return logits;
}

TEST(MoeRouteTest, SoftmaxTopKAndWeights) {
  const int64_t n = 5, experts = 8, k = 3;
  const Vec logits = Random(n * experts, 1, 2.0);
  for (bool normalize : {false, true}) {
    const Route r = RunRoute(logits, experts, k, normalize);
    for (int64_t i = 0; i < n; ++i) {
      const double* x = &logits[i * experts];
      const double max = *std::max_element(x, x + experts);
      double sum = 0;
      for (int64_t e = 0; e < experts; ++e) sum += std::exp(x[e] - max);
      for (int64_t e = 0; e < experts; ++e) EXPECT_NEAR(r.probs[i * experts + e], std::exp(x[e] - max) / sum, 1e-16);
      // the k largest, in decreasing order
      Vec sorted(r.probs.begin() + i * experts, r.probs.begin() + (i + 1) * experts);
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      double picked = 0;
      for (int64_t j = 0; j < k; ++j) picked += sorted[j];
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(r.probs[i * experts + r.top[i * k + j]], sorted[j]) << "row " << i << " pick " << j;
        EXPECT_DOUBLE_EQ(r.weights[i * k + j], normalize ? sorted[j] / picked : sorted[j]);
      }
    }
  }
}

// Probabilities 1e-12 apart (relative ~1e-11: distinct in f64) rank by value, whatever the index; equal ones by the
// lower expert index, the order torch.topk gives on the CPU.
TEST(MoeRouteTest, NearTiesByValueExactTiesByIndex) {
  const int64_t experts = 7;
  Vec logits(experts, -1.0);
  logits[5] = 0.3 + 1e-12;
  logits[2] = 0.3;
  logits[6] = 0.1;
  logits[1] = 0.1;
  logits[4] = 0.1;
  Route r = RunRoute(logits, experts, 5, true);
  EXPECT_EQ(r.top, (std::vector<int32_t>{5, 2, 1, 4, 6}));
  EXPECT_GT(r.probs[5], r.probs[2]);
  EXPECT_GT(r.weights[0], r.weights[1]);
  // the near tie the other way round
  logits[5] = 0.3 - 1e-12;
  r = RunRoute(logits, experts, 2, false);
  EXPECT_EQ(r.top, (std::vector<int32_t>{2, 5}));
  // all equal: the experts in index order
  r = RunRoute(Vec(experts, 0.25), experts, experts, false);
  EXPECT_EQ(r.top, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
}

TEST(MoeRouteTest, AllExpertsAndOne) {
  const int64_t n = 3, experts = 6;
  const Vec logits = Random(n * experts, 2);
  const Route all = RunRoute(logits, experts, experts, true), one = RunRoute(logits, experts, 1, true);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> perm(all.top.begin() + i * experts, all.top.begin() + (i + 1) * experts);
    std::sort(perm.begin(), perm.end());
    for (int64_t e = 0; e < experts; ++e) EXPECT_EQ(perm[e], e);
    for (int64_t j = 0; j < experts; ++j)
      EXPECT_NEAR(all.weights[i * experts + j], all.probs[i * experts + all.top[i * experts + j]], 1e-15);
    EXPECT_EQ(one.top[i], all.top[i * experts]);
    EXPECT_EQ(one.weights[i], 1.0);
  }
  // one normalised weight is constant: only the extra term has a gradient
  const Vec dw = Random(n, 3), extra = Random(experts, 4);
  const Vec d_dw = RunBackward(one, dw, experts, 1, true, nullptr);
  EXPECT_LT(MaxDiff(d_dw, Vec(n * experts, 0.0)), 1e-16);
  const Vec d_extra = RunBackward(one, Vec(n, 0.0), experts, 1, true, &extra);
  EXPECT_EQ(RunBackward(one, dw, experts, 1, true, &extra), d_extra);
}

struct GradientCase {
  int64_t k;
  bool normalize, extra;
};

class MoeRouteGradientTest : public ::testing::TestWithParam<GradientCase> {};

// d/dlogits of dot(weights, dw) + sum over rows of dot(probs, extra): the backward with dprobs_extra = extra.
TEST_P(MoeRouteGradientTest, AgainstFiniteDifferences) {
  const GradientCase c = GetParam();
  const int64_t n = 4, experts = 8;
  Vec logits = SpacedLogits(n, experts, 10 + c.k);
  const Vec dw = Random(n * c.k, 11), extra = Random(experts, 12);
  auto f = [&] {
    const Route r = RunRoute(logits, experts, c.k, c.normalize);
    double loss = Dot(r.weights, dw);
    if (c.extra)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t e = 0; e < experts; ++e) loss += r.probs[i * experts + e] * extra[e];
    return loss;
  };
  const Route r = RunRoute(logits, experts, c.k, c.normalize);
  const Vec dlogits = RunBackward(r, dw, experts, c.k, c.normalize, c.extra ? &extra : nullptr);
  EXPECT_LT(FiniteDifferenceError(f, logits, dlogits), 1e-8);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeRouteGradientTest,
                         ::testing::Values(GradientCase{3, true, false}, GradientCase{3, false, false},
                                           GradientCase{3, true, true}, GradientCase{3, false, true},
                                           GradientCase{8, true, true}, GradientCase{1, false, true},
                                           GradientCase{2, true, false}),
                         [](const ::testing::TestParamInfo<GradientCase>& info) {
                           const GradientCase& c = info.param;
                           return "k" + std::to_string(c.k) + (c.normalize ? "_normalized" : "") +
                                  (c.extra ? "_balance" : "");
                         });

TEST(MoeRouteTest, KOutsideTheExpertsIsRefused) {
  Vec logits(8), probs(8), weights(8);
  std::vector<int32_t> top(8);
  for (int64_t k : {0, 5})
    EXPECT_THROW(ops.moe_route(logits.data(), 2, 4, k, true, probs.data(), top.data(), weights.data()),
                 std::invalid_argument);
  top = {0, 4};  // expert 4 of 4
  EXPECT_THROW(ops.moe_route_backward(weights.data(), probs.data(), top.data(), 2, 4, 1, true, nullptr, logits.data()),
               std::invalid_argument);
}

// NaN logits give NaN probabilities but still k distinct experts.
TEST(MoeRouteTest, NanLogitsStillPickDistinctExperts) {
  Vec logits = {0.5, kNan, 0.2, 0.1};
  const Route r = RunRoute(logits, 4, 4, false);
  std::vector<int32_t> sorted = r.top;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(MoeRowsTest, GatherThenScatterAdd) {
  const int64_t src_rows = 9, cols = 5, rows = 4;
  const Vec src = Random(src_rows * cols, 20), scale = Random(rows, 21), dst0 = Random(src_rows * cols, 22);
  const std::vector<int32_t> index = {7, 2, 0, 5};
  Vec gathered(rows * cols, kNan);
  ops.gather_rows(src.data(), index.data(), rows, cols, gathered.data());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(gathered[i * cols + c], src[index[i] * cols + c]);
  for (bool scaled : {false, true}) {
    Vec dst = dst0;
    ops.scatter_add_rows(gathered.data(), index.data(), scaled ? scale.data() : nullptr, rows, cols, dst.data());
    Vec want = dst0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < cols; ++c)
        want[index[i] * cols + c] += (scaled ? scale[i] : 1.0) * src[index[i] * cols + c];
    EXPECT_EQ(dst, want) << "scaled " << scaled;
  }
}

TEST(MoeRowsTest, RowDots) {
  const int64_t rows = 6, cols = 7;
  const Vec a = Random(rows * cols, 30), b = Random(rows * cols, 31);
  Vec out(rows, kNan);
  ops.row_dots(a.data(), b.data(), rows, cols, out.data());
  for (int64_t i = 0; i < rows; ++i) {
    double want = 0;
    for (int64_t c = 0; c < cols; ++c) want += a[i * cols + c] * b[i * cols + c];
    EXPECT_EQ(out[i], want);
  }
}

std::vector<float> F32(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

TEST(MoeTest, F32CloseToF64) {
  const int64_t n = 40, experts = 16, k = 4, cols = 9;
  const Vec logits = SpacedLogits(n, experts, 40), dw = Random(n * k, 41), extra = Random(experts, 42);
  const Route r = RunRoute(logits, experts, k, true);
  const Vec dlogits = RunBackward(r, dw, experts, k, true, &extra);

  const OpTable<float>& ops32 = CpuOps<float>();
  const std::vector<float> x = F32(logits), dw32 = F32(dw), extra32 = F32(extra);
  std::vector<float> probs(n * experts), weights(n * k), dx(n * experts);
  std::vector<int32_t> top(n * k);
  ops32.moe_route(x.data(), n, experts, k, true, probs.data(), top.data(), weights.data());
  ops32.moe_route_backward(dw32.data(), probs.data(), top.data(), n, experts, k, true, extra32.data(), dx.data());
  EXPECT_EQ(top, r.top);
  EXPECT_LT(RelErr(probs, r.probs), 1e-6);
  EXPECT_LT(RelErr(weights, r.weights), 1e-6);
  EXPECT_LT(RelErr(dx, dlogits), 1e-5);

  const Vec a = Random(n * cols, 43), b = Random(n * cols, 44);
  Vec dots(n);
  ops.row_dots(a.data(), b.data(), n, cols, dots.data());
  const std::vector<float> a32 = F32(a), b32 = F32(b);
  std::vector<float> dots32(n);
  ops32.row_dots(a32.data(), b32.data(), n, cols, dots32.data());
  EXPECT_LT(RelErr(dots32, dots), 1e-6);
}

}  // namespace
}  // namespace sg
