// Every CPU op's backward against central finite differences in fp64, on shapes that exercise the edge cases
// (GQA, ragged pages, a query chunk that starts mid-page, ignored labels).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/finite_difference.h"
#include "kernels/cpu/vexp.h"

namespace sg {
namespace {

using testing_fd::Dot;
using testing_fd::FiniteDifferenceError;
using testing_fd::Random;
using testing_fd::Vec;

constexpr double kTol = 1e-7;
const OpTable<double>& ops = CpuOps<double>();

TEST(OpsTest, RmsNorm) {
  const int64_t n = 3, d = 7;
  Vec x = Random(n * d, 1), w = Random(d, 2), r = Random(n * d, 3);
  auto f = [&] {
    Vec y(n * d), rstd(n);
    ops.rmsnorm_forward(x.data(), w.data(), n, d, 1e-5, y.data(), rstd.data());
    return Dot(y, r);
  };
  Vec y(n * d), rstd(n), dx(n * d, 0.0), dw(d, 0.0);
  ops.rmsnorm_forward(x.data(), w.data(), n, d, 1e-5, y.data(), rstd.data());
  ops.rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), n, d, dx.data(), dw.data(), false);
  EXPECT_LT(FiniteDifferenceError(f, x, dx), kTol);
  EXPECT_LT(FiniteDifferenceError(f, w, dw), kTol);
}

TEST(OpsTest, RopeInverseIsBackward) {
  const int64_t n = 4, heads = 3, hd = 6;
  const std::vector<double> inv_freq = {1.0, 0.1, 0.01};
  Vec x = Random(n * heads * hd, 4), r = Random(n * heads * hd, 5);
  auto f = [&] {
    Vec y = x;
    ops.rope(y.data(), n, heads, hd, 11, inv_freq.data(), false);
    return Dot(y, r);
  };
  Vec dx = r;
  ops.rope(dx.data(), n, heads, hd, 11, inv_freq.data(), true);
  EXPECT_LT(FiniteDifferenceError(f, x, dx), kTol);
}

TEST(OpsTest, SwigluAndBias) {
  const int64_t n = 3, m = 5;
  Vec g = Random(n * m, 6), u = Random(n * m, 7), b = Random(m, 8), r = Random(n * m, 9);
  auto f = [&] {
    Vec out(n * m);
    ops.swiglu_forward(g.data(), u.data(), n * m, out.data());
    ops.add_bias(out.data(), b.data(), n, m);
    return Dot(out, r);
  };
  Vec dg(n * m), du(n * m), db(m, 0.0);
  ops.swiglu_backward(r.data(), g.data(), u.data(), n * m, dg.data(), du.data());
  ops.bias_backward(r.data(), n, m, db.data());
  EXPECT_LT(FiniteDifferenceError(f, g, dg), kTol);
  EXPECT_LT(FiniteDifferenceError(f, u, du), kTol);
  EXPECT_LT(FiniteDifferenceError(f, b, db), kTol);
}

TEST(OpsTest, EmbeddingWithRepeatedIds) {
  const int64_t vocab = 5, d = 3;
  const std::vector<int32_t> ids = {1, 4, 1, 0};
  Vec table = Random(vocab * d, 10), r = Random(ids.size() * d, 11);
  auto f = [&] {
    Vec out(ids.size() * d);
    ops.embedding_forward(ids.data(), ids.size(), table.data(), d, out.data());
    return Dot(out, r);
  };
  Vec dtable(vocab * d, 0.0);
  ops.embedding_backward(ids.data(), ids.size(), r.data(), d, dtable.data());
  EXPECT_LT(FiniteDifferenceError(f, table, dtable), kTol);
}

TEST(OpsTest, CrossEntropyIgnoresLabels) {
  const int64_t n = 4, vocab = 6;
  const std::vector<int32_t> labels = {2, -100, 5, 0};
  Vec logits = Random(n * vocab, 12, 2.0);
  auto f = [&] {
    Vec copy = logits;
    return ops.cross_entropy_forward_backward(copy.data(), labels.data(), n, vocab, nullptr, 1.0, nullptr);
  };
  Vec grad = logits;
  const double loss = ops.cross_entropy_forward_backward(grad.data(), labels.data(), n, vocab, nullptr, 1.0, nullptr);
  std::vector<double> lp(n);
  ops.token_logprobs(logits.data(), labels.data(), n, vocab, lp.data());
  EXPECT_NEAR(loss, -(lp[0] + lp[1] + lp[2] + lp[3]), 1e-12);
  // Left in (CPU) device memory instead: added to what is there, the same bits and gradient, 0 returned.
  Vec grad_dev = logits;
  double device_sum = 0.5;
  EXPECT_EQ(ops.cross_entropy_forward_backward(grad_dev.data(), labels.data(), n, vocab, nullptr, 1.0, &device_sum),
            0.0);
  EXPECT_EQ(device_sum, 0.5 + loss);
  EXPECT_EQ(grad_dev, grad);
  EXPECT_EQ(lp[1], 0.0);
  EXPECT_LT(FiniteDifferenceError(f, logits, grad), kTol);
}

// The loss is the rows' losses summed in row order, the same bits whatever the number of threads (an OpenMP
// reduction combined the threads' partial sums as they finished: the last bits varied between identical calls on a
// 16-core machine, and the CUDA sum, in row order, differed from the CPU's).
TEST(OpsTest, CrossEntropySumsInRowOrderWhateverTheThreads) {
  const int64_t n = 37, vocab = 50;
  std::vector<int32_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = i % 5 == 3 ? -100 : static_cast<int32_t>((i * 17) % vocab);
  const Vec logits = Random(n * vocab, 33, 4.0);
  double in_row_order = 0;
  for (int64_t i = 0; i < n; ++i) {  // one row per call: no reduction at all
    Vec row(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
    in_row_order += ops.cross_entropy_forward_backward(row.data(), &labels[i], 1, vocab, nullptr, 1.0, nullptr);
  }
  const int threads_before = omp_get_max_threads();
  for (int threads : {1, 3, 8, 16}) {
    omp_set_num_threads(threads);
    for (int repeat = 0; repeat < 20; ++repeat) {
      Vec grad = logits;
      ASSERT_EQ(ops.cross_entropy_forward_backward(grad.data(), labels.data(), n, vocab, nullptr, 1.0, nullptr),
                in_row_order)
          << threads << " threads, call " << repeat;
    }
  }
  omp_set_num_threads(threads_before);
}

// Arg max per labelled row: the lowest id among ties, NaN never wins, unlabelled rows get -1.
TEST(OpsTest, TokenArgmax) {
  const int64_t n = 4, vocab = 5;
  const double nan = std::nan("");
  const Vec logits = {0.1,  2.0,  -1.0, 2.0,  0.5,   // tie: 1
                      nan,  -3.0, -2.0, nan,  -2.5,  // NaN skipped: 2
                      9.0,  0.0,  0.0,  0.0,  0.0,   // unlabelled
                      -1.0, -1.0, -1.0, -1.0, 4.0};
  const std::vector<int32_t> labels = {0, 3, -100, 4};
  std::vector<int32_t> out(n, 7);
  ops.token_argmax(logits.data(), labels.data(), n, vocab, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, -1, 4}));
}

// Per-row scales turn the cross-entropy gradient into that of sum_i s_i (-logp_i): checked by finite differences.
TEST(OpsTest, CrossEntropyRowScales) {
  const int64_t n = 3, vocab = 5;
  const std::vector<int32_t> labels = {4, 0, -100};
  const std::vector<double> scales = {0.5, -2.0, 7.0};
  Vec logits = Random(n * vocab, 21, 2.0);
  auto f = [&] {
    std::vector<double> lp(n);
    ops.token_logprobs(logits.data(), labels.data(), n, vocab, lp.data());
    return -(scales[0] * lp[0] + scales[1] * lp[1] + scales[2] * lp[2]);
  };
  Vec grad = logits;
  ops.cross_entropy_forward_backward(grad.data(), labels.data(), n, vocab, scales.data(), 1.0, nullptr);
  EXPECT_LT(FiniteDifferenceError(f, logits, grad), kTol);
}

// Attention of a 5-query chunk at positions [3, 8) against a cache in pages of 3 tokens stored out of order.
// Parameterised by (kv_heads, threads): fewer KV heads than threads takes the key-stripe path of the backward.
class PagedAttentionTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(PagedAttentionTest, ForwardBackward) {
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(GetParam().second);
  AttentionShape s;
  s.n = 5;
  s.pos0 = 3;
  s.heads = 4;
  s.kv_heads = GetParam().first;
  s.head_dim = 4;
  s.scale = 0.5;
  const int64_t page_size = 3, stride = page_size * s.kv_heads * s.head_dim;
  const std::vector<int32_t> table = {2, 0, 3};  // logical -> pool page (pool has 4 pages)
  const int64_t pool = 4 * stride, qn = s.n * s.heads * s.head_dim;
  Vec k = Random(pool, 13), v = Random(pool, 14), q = Random(qn, 15), r = Random(qn, 16);
  auto view = [&](Vec& kk, Vec& vv) {
    return testing_fd::PagedView(kk.data(), vv.data(), table, page_size, s.kv_heads, s.head_dim);
  };
  Vec ws(ops.attention_workspace_elems(s, page_size));
  auto f = [&] {
    Vec out(qn), lse(s.heads * s.n);
    ops.attention_forward(s, q.data(), view(k, v), out.data(), lse.data(), ws.data());
    return Dot(out, r);
  };
  Vec out(qn), lse(s.heads * s.n), dq(qn), dk(pool, 0.0), dv(pool, 0.0);
  ops.attention_forward(s, q.data(), view(k, v), out.data(), lse.data(), ws.data());
  ops.attention_backward(s, q.data(), view(k, v), out.data(), lse.data(), r.data(), dq.data(), view(dk, dv), ws.data());
  EXPECT_LT(FiniteDifferenceError(f, q, dq), kTol);
  EXPECT_LT(FiniteDifferenceError(f, k, dk), kTol);
  EXPECT_LT(FiniteDifferenceError(f, v, dv), kTol);
  // Pool page 1 is not in the table: it must receive no gradient.
  for (int64_t i = stride; i < 2 * stride; ++i) EXPECT_EQ(dk[i], 0.0);

  // A gradient view that leaves logical page 1 out (-1): dQ and the other pages' dK/dV are unchanged, and
  // nothing is written for the missing page.
  const std::vector<int32_t> partial = {2, -1, 3};
  Vec dq2(qn), dk2(pool, 0.0), dv2(pool, 0.0);
  PagedKV<double> grad_view = view(dk2, dv2);
  grad_view.page_table = partial.data();
  ops.attention_backward(s, q.data(), view(k, v), out.data(), lse.data(), r.data(), dq2.data(), grad_view, ws.data());
  EXPECT_EQ(dq2, dq);
  for (int32_t page : {2, 3})
    for (int64_t i = page * stride; i < (page + 1) * stride; ++i) {
      EXPECT_EQ(dk2[i], dk[i]);
      EXPECT_EQ(dv2[i], dv[i]);
    }
  for (int64_t i = 0; i < stride; ++i) EXPECT_EQ(dk2[i], 0.0);  // pool page 0 backs logical page 1 normally
  omp_set_num_threads(threads_before);
}

// The vectorized f32 exp that attention uses: relative error near float rounding over the whole range that
// softmax feeds it (arguments <= 0), 0 below the underflow threshold, and finite up to 88.
TEST(OpsTest, VectorExpF32) {
  std::vector<float> x;
  for (double a = -120.0; a <= 88.0; a += 1e-3) x.push_back(static_cast<float>(a));
  std::vector<float> y = x;
  cpu::ExpShifted(y.data(), static_cast<int64_t>(y.size()), 0.0f);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(static_cast<double>(x[i]));
    if (x[i] < -87.0f) {
      EXPECT_EQ(y[i], 0.0f) << x[i];
    } else {
      worst = std::max(worst, std::abs(y[i] - ref) / ref);
    }
  }
  EXPECT_LT(worst, 4e-7);
  EXPECT_GT(worst, 0.0);  // it is not std::exp
}

INSTANTIATE_TEST_SUITE_P(GqaAndStripes, PagedAttentionTest,
                         ::testing::Values(std::make_pair(2, 1), std::make_pair(2, 2), std::make_pair(1, 2),
                                           std::make_pair(1, 3), std::make_pair(4, 2)));

TEST(OpsTest, AdamWFirstStepMovesByLr) {
  Vec p = {1.0, -2.0}, g = {0.5, -3.0}, m(2, 0.0), v(2, 0.0);
  ops.adamw(p.data(), g.data(), m.data(), v.data(), 2, 0.1, 0.9, 0.999, 1e-12, 0.0, 1);
  EXPECT_NEAR(p[0], 0.9, 1e-9);  // the bias-corrected first step is lr * sign(g)
  EXPECT_NEAR(p[1], -1.9, 1e-9);
}

}  // namespace
}  // namespace sg
